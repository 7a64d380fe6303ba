"""Plain-torch versions of every kernel: the truth the Triton kernels are tested against, and the
implementation the engine runs on CPU.

Attention is computed in float32 whatever the storage dtype, and cast back on the way out. Each
function checks its inputs like the Triton launchers do (see ``kvstore/kernels/_checks.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstore.kernels import _checks

# Quantized pages: the largest code magnitude of each code dtype (int8: symmetric, fp8: e4m3fn).
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_FP16_MAX = 65504.0


def quantize_rows(x: torch.Tensor, code_dtype: torch.dtype,
                  scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float rows ``x [..., head_dim]``: one scale per row (amax / QMAX, rounded *up* to
    ``scale_dtype``, so no value clips) and a code per value. A zero row has scale 0 and codes 0.

    Returns:
        ``(codes, scales)``: ``codes`` like ``x`` in ``code_dtype``, ``scales`` ``x.shape[:-1]``.
    """
    qmax = QMAX[code_dtype]
    xf = x.float()
    ideal = xf.abs().amax(dim=-1) / qmax
    scales = ideal.to(scale_dtype)
    if scale_dtype != torch.float32:
        low = scales.float() < ideal  # round up: for positive floats the next value is the next bit pattern
        scales = scales.view(torch.int16).add_(low.to(torch.int16)).view(scale_dtype)
        scales = scales.clamp_(max=_FP16_MAX) if scale_dtype == torch.float16 else scales
    divisor = scales.float()
    divisor = torch.where(divisor > 0, divisor, 1.0).unsqueeze(-1)
    if code_dtype == torch.int8:
        codes = (xf / divisor).round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        codes = (xf / divisor).clamp_(-qmax, qmax).to(code_dtype)
    return codes, scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``codes * scales[..., None]`` (codes int8 or float8_e4m3fn)."""
    if codes.dtype == torch.float8_e4m3fn:  # through float16 bits, as dequantize_fp8 (torch's own cast is slow)
        bits = codes.view(torch.int8).to(torch.int16)
        values = bits.bitwise_left_shift_(7).bitwise_and_(-0x4001).view(torch.float16).float()
        return values.mul_(scales.float().mul(256.0).unsqueeze(-1))
    return torch.mul(codes, scales.float().unsqueeze(-1))  # int8 times float32: one pass, promoted


def _gather_paged(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  scales: torch.Tensor | None = None, starts: torch.Tensor | None = None) -> torch.Tensor:
    """Gather each sequence's rows contiguous: ``[num_seqs, max_len, kv_heads, head_dim]`` (float32;
    codes times their ``scales`` for quantized pages: only the rows a sequence reads are decoded).

    Rows past a sequence's length, and below ``starts`` (a sliding window's first position), are
    zero: the slots behind them hold stale bytes (maybe inf or NaN: below a window, a block the
    store never delivered), and a masked score times a NaN value would still poison the output.
    """
    num_seqs = block_tables.shape[0]
    block_size = cache.shape[1]
    lens = seq_lens.long()
    max_len = int(lens.max()) if num_seqs else 0
    num_cols = -(-max_len // block_size)
    table = block_tables[:, :num_cols].long()
    # Entries past ceil(seq_len / block_size) are never meaningful (padding such as -1).
    in_use = torch.arange(num_cols, device=table.device) < ((lens + block_size - 1) // block_size)[:, None]
    table = torch.where(in_use, table, 0)
    # index_select reads only the chosen blocks of the strided per-layer view; plain advanced
    # indexing (cache[table]) first materialises the whole layer slice of the pool.
    picked = cache.index_select(0, table.flatten()).view(num_seqs, num_cols, *cache.shape[1:])
    if scales is not None:
        picked_scales = scales.index_select(0, table.flatten()).view(num_seqs, num_cols, *scales.shape[1:])
        picked = dequantize_rows(picked, picked_scales)
    rows = picked.float().flatten(1, 2)[:, :max_len]  # [num_seqs, max_len, kv_heads, head_dim]
    positions = torch.arange(max_len, device=rows.device)
    in_seq = positions < lens[:, None]
    if starts is not None:
        in_seq &= positions >= starts[:, None]
    return torch.where(in_seq[:, :, None, None], rows, 0.0)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Reference of ``kernels.paged_decode_attention`` (one query row per sequence; with
    ``window``, over its sequence's last ``window`` positions)."""
    num_blocks, block_size, num_kv_heads, head_dim = _checks.check_paged_cache(k_cache, v_cache, k_scales, v_scales)
    num_seqs, num_heads, _ = _checks.check_query("q", q, k_cache)
    _checks.check_block_table(block_tables, seq_lens, num_seqs, num_blocks, block_size)
    _checks.check_window(window)
    out = _checks.check_out(out, q)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    # the new token at n - 1 sees [n - window, n) (its own included)
    starts = None if window is None else (seq_lens.long() - window).clamp_(min=0)
    keys = _gather_paged(k_cache, block_tables, seq_lens, k_scales, starts).transpose(1, 2)  # [S, kvh, T, D]
    values = _gather_paged(v_cache, block_tables, seq_lens, v_scales, starts).transpose(1, 2)
    if keys.shape[2] == 0:
        return out.zero_()
    # The `group` query heads sharing a KV head become `group` query rows of that head.
    queries = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    lens = seq_lens.long()
    positions = torch.arange(keys.shape[2], device=q.device)
    visible = positions < lens[:, None]  # [S, T]
    if starts is not None:
        visible &= positions >= starts[:, None]
    attn = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=visible[:, None, None, :], scale=scale
    )
    # A sequence of length 0 sees nothing; its output is defined as zeros.
    attn = torch.where((lens > 0)[:, None, None, None], attn, 0.0)
    out.copy_(attn.reshape(num_seqs, num_heads, head_dim))
    return out


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
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Reference of ``kernels.paged_prefill_attention`` (causal over the cached prefix + new rows;
    with ``window``, each row over the last ``window`` positions up to its own)."""
    _checks.check_window(window)
    num_blocks, block_size, num_kv_heads, head_dim = _checks.check_paged_cache(k_cache, v_cache, k_scales, v_scales)
    total_tokens, num_heads, _ = _checks.check_query("q", q, k_cache)
    num_seqs = _checks.check_tensor("seq_lens", seq_lens, 1, (torch.int32,)).shape[0]
    _checks.check_block_table(block_tables, seq_lens, num_seqs, num_blocks, block_size)
    _checks.check_cu_seqlens(cu_seqlens_q, seq_lens, total_tokens)
    out = _checks.check_out(out, q)
    group = num_heads // num_kv_heads
    starts = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        context_len = seq_len - q_len
        # the first new row's window start: nothing below it is read
        first = None if window is None else torch.tensor([max(0, context_len - window + 1)], device=q.device)
        keys = _gather_paged(k_cache, block_tables[i : i + 1], seq_lens[i : i + 1], k_scales, first)[0].transpose(0, 1)
        values = _gather_paged(v_cache, block_tables[i : i + 1], seq_lens[i : i + 1], v_scales, first)[0].transpose(0, 1)
        # New row r sits at absolute position p = context_len + r and sees positions [0, p], or
        # with a window (p - window, p].
        positions = torch.arange(seq_len, device=q.device)
        at = (context_len + torch.arange(q_len, device=q.device))[:, None]
        visible = positions[None, :] <= at
        if window is not None:
            visible &= positions[None, :] > at - window
        # [q_len, H, D] -> [kvh, group * q_len, D]: rows of one KV head share its keys.
        queries = q[start:end].float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        attn = F.scaled_dot_product_attention(
            queries.reshape(num_kv_heads, group * q_len, head_dim),
            keys,
            values,
            attn_mask=visible.repeat(group, 1),
            scale=scale,
        )
        attn = attn.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[start:end] = attn.reshape(q_len, num_heads, head_dim)
    return out


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    *, k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
) -> None:
    """Reference of ``kernels.store_kv``: row t goes to slot ``slot_mapping[t]`` (-1: skipped);
    with scales, quantized first (``quantize_rows``)."""
    _checks.check_store_kv(key, value, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    if k_scales is not None and v_scales is not None:
        block_size = k_cache.shape[1]
        for cache, scales, rows in ((k_cache, k_scales, key[keep]), (v_cache, v_scales, value[keep])):
            codes, row_scales = quantize_rows(rows, cache.dtype, scales.dtype)
            cache[slots // block_size, slots % block_size] = codes
            scales[slots // block_size, slots % block_size] = row_scales
        return
    for cache, rows in ((k_cache, key[keep]), (v_cache, value[keep])):
        if _has_token_rows(cache):
            _token_rows(cache).index_copy_(0, _row_ids(cache, slots), rows)
        else:  # an unusual stride pattern: index the 4-d view (slower, same result)
            block_size = cache.shape[1]
            cache[slots // block_size, slots % block_size] = rows


def _has_token_rows(cache: torch.Tensor) -> bool:
    row = cache.stride(1)
    return cache.stride(3) == 1 and cache.stride(2) == cache.shape[3] and row == cache.shape[2] * cache.shape[3] \
        and cache.stride(0) % row == 0 and cache.stride(0) >= cache.shape[1] * row


def _token_rows(cache: torch.Tensor) -> torch.Tensor:
    """The strided per-layer view as one row per token slot of the pool: ``[rows, kv_heads, head_dim]``.

    In the block-major pool a layer's block b starts ``stride(0)`` elements after block b - 1 and
    its tokens are ``stride(1)`` apart, so every token row of every block is a row of this view
    (rows between blocks belong to other layers and are never addressed). Writing through it is
    a plain index_copy; advanced indexing on the 4-d view would copy the whole layer slice.
    """
    num_blocks, block_size, heads, dim = cache.shape
    row = cache.stride(1)
    num_rows = (num_blocks - 1) * (cache.stride(0) // row) + block_size
    return cache.as_strided((num_rows, heads, dim), (row, dim, 1))


def _row_ids(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    block_size = cache.shape[1]
    return (slots // block_size) * (cache.stride(0) // cache.stride(1)) + slots % block_size


def gather_blocks(pool: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of ``kernels.gather_blocks``: ``out[i] = pool[block_ids[i]]``."""
    if out is None:
        out = torch.empty((block_ids.shape[0], *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    _checks.check_block_copy(pool, block_ids, out, unique=False)
    ids = block_ids.to(pool.device, torch.long)
    if out.device == pool.device:
        torch.index_select(pool, 0, ids, out=out)
    else:
        out.copy_(pool.index_select(0, ids))
    return out


def scatter_blocks(pool: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Reference of ``kernels.scatter_blocks``: ``pool[block_ids[i]] = src[i]``."""
    _checks.check_block_copy(pool, block_ids, src, unique=True)
    pool.index_copy_(0, block_ids.to(pool.device, torch.long), src.to(pool.device))


def dequantize_int8(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Reference of ``kernels.dequantize_int8``: ``out[b, r] = data[b, r] * scales[b, r]``."""
    _checks.check_dequantize_int8(data, scales, out)
    # The product of an int8 and a float16 or float32 scale is formed in float32 and rounded
    # once into out, as the kernel does. (On the CPU this float32 pass, with its temporary,
    # is also faster than multiplying in float16 in place: every float16 op converts anyway.)
    column = scales.float().unsqueeze(-1)
    if out.dtype == torch.float32:
        out.copy_(data)  # |q| <= 127: exact
        out.mul_(column)
    else:
        out.copy_(data.float().mul_(column))
    return out


def dequantize_fp8(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Reference of ``kernels.dequantize_fp8``: ``out[b, r] = e4m3(data[b, r]) * scales[b, r]``."""
    _checks.check_dequantize_fp8(data, scales, out)
    # e4m3fn bits moved into float16 bits give the value times 2**-8, exactly (torch converts
    # float8 one element at a time on the CPU): the byte widened with its sign extended, << 7,
    # bit 14 cleared. Then the product with the scale, in float32, rounded once into out.
    bits = data.view(torch.int8).to(torch.int16)
    values = bits.bitwise_left_shift_(7).bitwise_and_(-0x4001).view(torch.float16).float()
    out.copy_(values.mul_(scales.float().mul(256.0).unsqueeze(-1)))
    return out
