"""Paged decode attention in Triton: one query row per sequence against its paged KV.

One program serves one (sequence, KV head) pair and all ``group`` query heads that share that KV
head, so each K/V row is read once per group (grouped-query attention). The split-K variant adds
a third grid axis over partitions of the context; each partition writes a normalised partial
output and its log-sum-exp, and ``_reduce_kernel`` merges them.

With a sliding window W the new token (position ``seq_len - 1``) reads positions ``[lo, seq_len)``,
``lo = max(0, seq_len - W)``: the loop (and the split-K partitions) start at ``lo``, so blocks below
the window are never read. Full attention passes a window longer than any sequence (``lo = 0``).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kvstore.kernels import _checks
from kvstore.kernels._quant import decode_codes

PARTITION_SIZE = 512  # tokens per split-K partition (a multiple of every tile size used here)
_LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, tables_ptr, lens_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, num_heads, num_partitions, window,
    stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    stride_os, stride_oh, stride_table,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PARTITION: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(lens_ptr + seq)
    lo = tl.maximum(seq_len - window, 0)  # the window's first position
    if SPLIT:
        part = tl.program_id(2)
        start = lo + part * PARTITION
        end = tl.minimum(seq_len, start + PARTITION)
    else:
        start = lo
        end = seq_len
    rows = tl.arange(0, GROUP_PAD)  # padded to 16 rows: tl.dot needs M >= 16
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)

    # Online softmax in base 2: scores carry log2(e) inside scale_log2.
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    offs = tl.arange(0, TILE_N)
    table_row = tables_ptr + seq.to(tl.int64) * stride_table
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + offs
        valid = pos < end
        # Table entries past the sequence are never read: they may be padding.
        block_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row_off = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & dim_mask[None, :]  # masked rows may hold NaN garbage: never load them
        k = tl.load(k_ptr + block_ids[:, None] * stride_kb + row_off[:, None] * stride_kt + kv_head * stride_kh + dims[None, :], mask=kv_mask, other=0)
        if QUANT:  # codes times their row's scale, decoded in registers as they are read
            k_scale = tl.load(ks_ptr + block_ids * stride_ksb + row_off * stride_kst + kv_head * stride_ksh, mask=valid, other=0.0)
            k = (decode_codes(k, FP8) * k_scale.to(tl.float32)[:, None]).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        # The first tile of a non-empty range has a valid position, so m_new is finite from here on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + block_ids[:, None] * stride_vb + row_off[:, None] * stride_vt + kv_head * stride_vh + dims[None, :], mask=kv_mask, other=0)
        if QUANT:
            v_scale = tl.load(vs_ptr + block_ids * stride_vsb + row_off * stride_vst + kv_head * stride_vsh, mask=valid, other=0.0)
            v = (decode_codes(v, FP8) * v_scale.to(tl.float32)[:, None]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty range (length 0) yields zeros, not NaN
    result = acc / l_safe[:, None]
    if SPLIT:
        # part_out [S, H, P, D] and part_lse [S, H, P], both float32 and contiguous.
        part_idx = (seq * num_heads + heads).to(tl.int64) * num_partitions + part
        tl.store(part_out_ptr + part_idx[:, None] * HEAD_DIM + dims[None, :], result, mask=q_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part_idx, lse, mask=row_mask)
    else:
        out_ptrs = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lens_ptr, num_heads, num_partitions, window, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PARTITION: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(lens_ptr + seq)
    num_used = tl.cdiv(seq_len - tl.maximum(seq_len - window, 0), PARTITION)  # partitions from the window's start
    base = (seq * num_heads + head).to(tl.int64) * num_partitions
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    # Pass 1: the largest log-sum-exp. Every used partition holds >= 1 token, so it is finite.
    running_max = tl.full([CHUNK], float("-inf"), tl.float32)
    for first in range(0, num_used, CHUNK):
        parts = first + tl.arange(0, CHUNK)
        lse = tl.load(part_lse_ptr + base + parts, mask=parts < num_used, other=float("-inf"))
        running_max = tl.maximum(running_max, lse)
    m = tl.max(running_max, 0)
    # Pass 2: weight each partition's normalised output by its share of the softmax mass.
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    weights = tl.zeros([CHUNK], tl.float32)
    for first in range(0, num_used, CHUNK):
        parts = first + tl.arange(0, CHUNK)
        used = parts < num_used
        w = tl.where(used, tl.exp2(tl.load(part_lse_ptr + base + parts, mask=used, other=0.0) - m), 0.0)
        o = tl.load(part_out_ptr + (base + parts)[:, None] * HEAD_DIM + dims[None, :], mask=used[:, None] & dim_mask[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        weights += w
    total = tl.sum(weights, 0)
    result = acc / tl.where(total > 0, total, 1.0)
    out_ptrs = out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + dims
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=dim_mask)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _should_split(num_programs: int, num_partitions: int, device: torch.device) -> bool:
    # Split when the context spans several partitions and one program per (sequence, KV head)
    # would leave the GPU's SMs under-filled (fewer than 4 programs each).
    if num_partitions < 4 or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return num_programs < 4 * _num_sms(index)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    split_k: bool | None = None,
    partition_size: int = PARTITION_SIZE,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Triton launcher of ``kernels.paged_decode_attention``; ``partition_size`` is for tests."""
    num_blocks, block_size, num_kv_heads, head_dim = _checks.check_paged_cache(k_cache, v_cache, k_scales, v_scales)
    num_seqs, num_heads, _ = _checks.check_query("q", q, k_cache)
    _checks.check_block_table(block_tables, seq_lens, num_seqs, num_blocks, block_size)
    _checks.check_power_of_two_block(block_size)
    _checks.check_head_dim(head_dim)
    _checks.check_window(window)
    _checks.check_launchable(_decode_kernel, q.device)
    out = _checks.check_out(out, q)
    tile_n = max(64, block_size)
    if partition_size <= 0 or partition_size % tile_n:
        raise ValueError(f"partition_size must be a positive multiple of {tile_n}, got {partition_size}")
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    elif seq_lens.device.type == "cpu" and int(seq_lens.max()) > max_seq_len:
        raise ValueError(f"max_seq_len {max_seq_len} is below the longest sequence, {int(seq_lens.max())} tokens")
    # partitions cover the window (from its start), at most the longest sequence
    span = max_seq_len if window is None else min(max_seq_len, window)
    num_partitions = max(1, math.ceil(span / partition_size))
    window_arg = _checks.FULL_WINDOW if window is None else window
    if split_k is None:
        split_k = _should_split(num_seqs * num_kv_heads, num_partitions, q.device)
    group = num_heads // num_kv_heads
    head_dim_pad = triton.next_power_of_2(head_dim)
    part_out, part_lse = out, seq_lens  # placeholders: unused by the single-pass kernel
    if split_k:
        part_out = torch.empty((num_seqs, num_heads, num_partitions, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, num_heads, num_partitions), dtype=torch.float32, device=q.device)
    grid = (num_seqs, num_kv_heads, num_partitions if split_k else 1)
    quant = k_scales is not None and v_scales is not None
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:  # its bytes, read as int8 and decoded by their bit pattern (kernels/_quant.py)
        k_cache, v_cache = k_cache.view(torch.int8), v_cache.view(torch.int8)
    ks, vs = (k_scales, v_scales) if quant else (seq_lens, seq_lens)  # placeholders: unused unless QUANT
    scale_strides = (*k_scales.stride(), *v_scales.stride()) if quant else (0,) * 6  # type: ignore[union-attr]
    with _checks.device_guard(q.device):
        _decode_kernel[grid](
            q, k_cache, v_cache, ks, vs, out, block_tables, seq_lens, part_out, part_lse,
            scale * _LOG2E, num_heads, num_partitions, window_arg,
            q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], *scale_strides,
            out.stride(0), out.stride(1), block_tables.stride(0),
            GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, TILE_N=tile_n, PARTITION=partition_size,
            SPLIT=bool(split_k), DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            QUANT=quant, FP8=fp8, num_warps=4,
        )  # fmt: skip
        if split_k:
            _reduce_kernel[(num_seqs, num_heads)](
                part_out, part_lse, out, seq_lens, num_heads, num_partitions, window_arg, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, PARTITION=partition_size, CHUNK=16, num_warps=4,
            )  # fmt: skip
    return out
