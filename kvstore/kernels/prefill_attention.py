"""Paged prefill attention in Triton: new rows of several sequences, causal over cache + themselves.

The new rows' K/V are already in the pool (``store_kv`` ran first), so every key is read through
the block table. One program serves BLOCK_M new rows of one sequence for one query head; heads
are the fastest grid axis so the heads sharing a KV head run side by side and share it in L2.

Row r of a sequence with ``q_len`` new rows and length ``seq_len`` sits at absolute position
``p = context_len + r`` (``context_len = seq_len - q_len``) and sees keys ``[0, p]``::

    keys  0 ............ context_len ........ seq_len
    row 0 xxxxxxxxxxxxxxxx x
    row 1 xxxxxxxxxxxxxxxx xx
    row r xxxxxxxxxxxxxxxx xx...x (r + 1 new keys)

With a sliding window W, row r sees ``(p - W, p]`` only::

    keys  0 ............ context_len ........ seq_len
    row 0          xxxxxxx x                 (W keys, its own last)
    row r                 xxxxxxxx           (p - W, p]

A tile of rows starts its loop at its first row's window start; tiles of keys that some row's
window begins inside are masked on that side too. Full attention passes a window longer than
any sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.kernels import _checks
from kvstore.kernels._quant import decode_codes

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, tables_ptr, lens_ptr, cu_ptr, scale_log2, window,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vh,
    stride_sb, stride_st, stride_sh,
    stride_ot, stride_oh, stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    m_block = tl.program_id(1)
    seq = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    seq_len = tl.load(lens_ptr + seq)
    context_len = seq_len - q_len
    first_row = m_block * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_mask = row_mask[:, None] & dim_mask[None, :]
    token = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=q_mask, other=0.0)

    # Grids are sized by the longest sequence: a program past its sequence's rows does nothing.
    has_rows = first_row < q_len
    # Keys below `unmasked_end` are visible to every row of this tile (all lie at or before
    # context_len + first_row); keys in [unmasked_end, kv_end) need the causal/length mask.
    last_row = tl.minimum(q_len, first_row + BLOCK_M) - 1
    kv_end = tl.where(has_rows, context_len + last_row + 1, 0)
    unmasked_end = tl.where(has_rows, (context_len + first_row + 1) // BLOCK_N * BLOCK_N, 0)
    # The window: the first row sees keys from kv_start on; keys from masked_below on are seen
    # by the last row too (below it, the window's side of the mask applies).
    kv_lo = tl.maximum(context_len + first_row - window + 1, 0)
    kv_start = kv_lo // BLOCK_N * BLOCK_N
    masked_below = context_len + last_row - window + 1
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    table_row = tables_ptr + seq.to(tl.int64) * stride_table
    k_base = k_ptr + kv_head * stride_kh + dims[None, :]
    v_base = v_ptr + kv_head * stride_vh + dims[None, :]
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        pos = tile_start + offs
        # below kv_lo lie keys no row of the tile sees (maybe blocks never written): never loaded
        in_seq = (pos < kv_end) & (pos >= kv_lo)
        block_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        kv_off = block_ids[:, None] * stride_kb + (pos % BLOCK_SIZE)[:, None] * stride_kt
        kv_mask = in_seq[:, None] & dim_mask[None, :]
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0)
        if QUANT:  # codes times their row's scale, decoded in registers as they are read
            s_off = block_ids * stride_sb + (pos % BLOCK_SIZE) * stride_st + kv_head * stride_sh
            k = (decode_codes(k, FP8) * tl.load(ks_ptr + s_off, mask=in_seq, other=0.0).to(tl.float32)[:, None]).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if (tile_start + BLOCK_N > unmasked_end) | (tile_start < masked_below):
            at = (context_len + rows)[:, None]
            visible = (pos[None, :] <= at) & (pos[None, :] > at - window) & in_seq[None, :]
            s = tl.where(visible, s, float("-inf"))
        # A row may see nothing of a tile below its window, so its running max can still be
        # -inf here: exponents are taken from 0 then (alpha and p come out 0, not NaN).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # K and V strides match (check_paged_cache), so one offset serves both.
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0)
        if QUANT:
            v = (decode_codes(v, FP8) * tl.load(vs_ptr + s_off, mask=in_seq, other=0.0).to(tl.float32)[:, None]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + token[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    block_m: int = 64,
    block_n: int = 64,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Triton launcher of ``kernels.paged_prefill_attention``; ``block_m``/``block_n`` are tile sizes."""
    num_blocks, block_size, num_kv_heads, head_dim = _checks.check_paged_cache(k_cache, v_cache, k_scales, v_scales)
    total_tokens, num_heads, _ = _checks.check_query("q", q, k_cache)
    num_seqs = _checks.check_tensor("seq_lens", seq_lens, 1, (torch.int32,)).shape[0]
    _checks.check_block_table(block_tables, seq_lens, num_seqs, num_blocks, block_size)
    _checks.check_cu_seqlens(cu_seqlens_q, seq_lens, total_tokens)
    _checks.check_power_of_two_block(block_size)
    _checks.check_head_dim(head_dim)
    _checks.check_window(window)
    _checks.check_launchable(_prefill_kernel, q.device)
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache strides {k_cache.stride()} must equal v_cache strides {v_cache.stride()}")
    quant = k_scales is not None and v_scales is not None
    if quant and k_scales.stride() != v_scales.stride():  # type: ignore[union-attr]
        raise ValueError(f"k_scales strides {k_scales.stride()} must equal v_scales strides "  # type: ignore[union-attr]
                         f"{v_scales.stride()}")  # type: ignore[union-attr]
    for name, tile in (("block_m", block_m), ("block_n", block_n)):
        if tile < 16 or tile & (tile - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {tile}")
    out = _checks.check_out(out, q)
    if num_seqs == 0 or total_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # a host sync on CUDA
    grid = (num_heads, triton.cdiv(max_query_len, block_m), num_seqs)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:  # its bytes, read as int8 and decoded by their bit pattern (kernels/_quant.py)
        k_cache, v_cache = k_cache.view(torch.int8), v_cache.view(torch.int8)
    ks, vs = (k_scales, v_scales) if quant else (seq_lens, seq_lens)  # placeholders: unused unless QUANT
    scale_strides = k_scales.stride() if quant else (0, 0, 0)  # type: ignore[union-attr]
    with _checks.device_guard(q.device):
        _prefill_kernel[grid](
            q, k_cache, v_cache, ks, vs, out, block_tables, seq_lens, cu_seqlens_q, scale * _LOG2E,
            _checks.FULL_WINDOW if window is None else window,
            q.stride(0), q.stride(1), *k_cache.stride()[:3], v_cache.stride(2), *scale_strides,
            out.stride(0), out.stride(1), block_tables.stride(0),
            GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QUANT=quant, FP8=fp8,
            num_warps=4 if block_m <= 64 else 8,
        )  # fmt: skip
    return out
