"""Input checks shared by the Triton launchers and the references.

Every check raises ValueError naming the numbers. Checks that would read device memory (the
range of block ids, lengths against the block table) only run on CPU tensors: on CUDA they would
force a host sync on every decode step, so there the caller's allocator is trusted.
"""

from __future__ import annotations

import contextlib

import torch

ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# quantized pages: one code per value, one scale per (token, head) row (kernels.PAGE_CODES)
CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)
SCALE_DTYPES = (torch.float16, torch.float32)


def check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """Check that ``t`` is a tensor of ``ndim`` dims with one of ``dtypes``; return it."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    return t


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must share one device, got {devices}")


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None = None,
                      v_scales: torch.Tensor | None = None) -> tuple[int, int, int, int]:
    """Check one layer's K and V views ``[num_blocks, block_size, kv_heads, head_dim]``: float
    values, or, with ``k_scales``/``v_scales`` ``[num_blocks, block_size, kv_heads]``, codes.

    Returns:
        ``(num_blocks, block_size, num_kv_heads, head_dim)``.
    """
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales go together: both (quantized pages) or neither")
    dtypes = ATTENTION_DTYPES if k_scales is None else CODE_DTYPES
    check_tensor("k_cache", k_cache, 4, dtypes)
    check_tensor("v_cache", v_cache, 4, dtypes)
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if scales is None:
            continue
        check_tensor(name, scales, 3, SCALE_DTYPES)
        if tuple(scales.shape) != tuple(k_cache.shape[:3]):
            raise ValueError(f"{name} shape {tuple(scales.shape)} must be {tuple(k_cache.shape[:3])} "
                             "(one scale per token and KV head of the cache)")
        check_same_device(k_cache=k_cache, **{name: scales})
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} "
            f"{v_cache.dtype} must match"
        )
    check_same_device(k_cache=k_cache, v_cache=v_cache)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        # Kernels vectorise along head_dim; the other strides are free (pool views are strided).
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_query(name: str, q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int]:
    """Check ``q`` ``[rows, num_heads, head_dim]`` against the cache; return its shape."""
    check_tensor(name, q, 3, ATTENTION_DTYPES)
    check_same_device(**{name: q, "k_cache": k_cache})
    rows, num_heads, head_dim = q.shape
    num_kv_heads, cache_head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.dtype != k_cache.dtype and k_cache.dtype not in CODE_DTYPES:
        raise ValueError(f"{name} dtype {q.dtype} must equal the cache dtype {k_cache.dtype}")
    if head_dim != cache_head_dim:
        raise ValueError(f"{name} head_dim {head_dim} must equal the cache head_dim {cache_head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{name} has {num_heads} heads, not a multiple of {num_kv_heads} KV heads")
    if q.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in head_dim, got strides {q.stride()}")
    return rows, num_heads, head_dim


def check_out(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Return ``out`` after checking it matches ``like``, or a new empty tensor like it."""
    if out is None:
        return torch.empty_like(like)
    check_tensor("out", out, like.dim(), (like.dtype,))
    if out.shape != like.shape or out.device != like.device:
        raise ValueError(f"out {tuple(out.shape)} on {out.device} must be {tuple(like.shape)} on {like.device}")
    if out.stride(-1) != 1:
        raise ValueError(f"out must be contiguous in head_dim, got strides {out.stride()}")
    return out


def check_block_table(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_seqs: int, num_blocks: int, block_size: int
) -> None:
    """Check ``block_tables`` ``[num_seqs, max_blocks]`` int32 and ``seq_lens`` ``[num_seqs]`` int32.

    On CPU also check that each length fits the table and that every entry a sequence uses (the
    first ``ceil(seq_len / block_size)``) names a block in ``[0, num_blocks)``. Entries past that
    are never read and may hold anything (e.g. -1 padding).
    """
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows and seq_lens {seq_lens.shape[0]} entries; "
            f"expected {num_seqs} sequences"
        )
    if block_tables.stride(-1) != 1 and block_tables.shape[1] > 1:
        raise ValueError(f"block_tables rows must be contiguous, got strides {block_tables.stride()}")
    if block_tables.device.type != "cpu" or num_seqs == 0:
        return
    max_blocks = block_tables.shape[1]
    lens = seq_lens.long()
    if int(lens.min()) < 0 or int(lens.max()) > max_blocks * block_size:
        raise ValueError(
            f"seq_lens must lie in [0, {max_blocks * block_size}] ({max_blocks} blocks of {block_size}), "
            f"got min {int(lens.min())} max {int(lens.max())}"
        )
    used = torch.arange(max_blocks) < ((lens + block_size - 1) // block_size)[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        seq, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_tables[{seq}, {col}] = {int(block_tables[seq, col])} is outside [0, {num_blocks}) "
            f"(sequence {seq} has length {int(lens[seq])})"
        )


FULL_WINDOW = 2**31 - 1  # the window the Triton kernels are given for full attention: longer than any sequence


def check_window(window: int | None) -> None:
    """A sliding window is None (full attention) or a positive int of positions, the query's own included."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")


def check_power_of_two_block(block_size: int) -> None:
    # tl.dot needs every dim >= 16 and tiles are powers of two.
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"Triton kernels need a power-of-two block_size >= 16, got {block_size}")


def check_head_dim(head_dim: int) -> None:
    if head_dim % 16 != 0:
        raise ValueError(f"head_dim must be a multiple of 16, got {head_dim}")


def check_launchable(kernel: object, device: torch.device) -> None:
    """Compiled Triton kernels run on CUDA tensors; CPU tensors need the Triton interpreter."""
    from triton.runtime import JITFunction

    # The interpreter flag is read when @triton.jit decorates, i.e. when the kernel module is
    # first imported; setting it later does not turn compiled kernels into interpreted ones.
    if device.type != "cuda" and isinstance(kernel, JITFunction):
        raise ValueError(
            f"Triton kernels got {device} tensors; set TRITON_INTERPRET=1 before kernels' Triton "
            "modules are imported, or use KVSTORE_KERNELS=reference"
        )


def check_cu_seqlens(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, total_tokens: int) -> None:
    """Check ``cu_seqlens_q`` ``[num_seqs + 1]`` int32: starts at 0, ends at ``total_tokens``, each
    sequence's new tokens fit its length (the last two on CPU only)."""
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,))
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries; expected num_seqs + 1 = {seq_lens.shape[0] + 1}"
        )
    if cu_seqlens_q.device.type != "cpu":
        return
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != total_tokens or bool((q_lens < 0).any()):
        raise ValueError(
            f"cu_seqlens_q must rise from 0 to {total_tokens} (q rows), got {cu.tolist()[:8]}...{int(cu[-1])}"
        )
    too_long = (q_lens > seq_lens.long()).nonzero()
    if too_long.numel():
        i = int(too_long[0])
        raise ValueError(f"sequence {i} has {int(q_lens[i])} new tokens but seq_len {int(seq_lens[i])}")


def check_store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
) -> None:
    """Check new rows ``[num_tokens, kv_heads, head_dim]`` and their int64 slots against the cache
    (float rows of any attention dtype for quantized pages, else the cache's dtype)."""
    num_blocks, block_size, num_kv_heads, head_dim = check_paged_cache(k_cache, v_cache, k_scales, v_scales)
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, 3, (k_cache.dtype,) if k_scales is None else ATTENTION_DTYPES)
        if tuple(t.shape[1:]) != (num_kv_heads, head_dim) or t.shape[0] != key.shape[0]:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} must be [{key.shape[0]}, {num_kv_heads}, {head_dim}]"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
    check_same_device(key=key, value=value, k_cache=k_cache, slot_mapping=slot_mapping)
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        num_slots = num_blocks * block_size
        bad = ((slot_mapping < -1) | (slot_mapping >= num_slots)).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"slot_mapping[{i}] = {int(slot_mapping[i])} is outside [-1, {num_slots})")


def check_block_copy(pool: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, unique: bool) -> None:
    """Check a pool ``[num_blocks, *block_shape]``, int ids ``[n]`` and staging ``[n, *block_shape]``.

    Each block must be one contiguous payload (the design's block-major layout). ``unique``
    demands distinct ids (scatter: two writes to one block would race); checked on CPU ids only.
    """
    if not isinstance(pool, torch.Tensor) or pool.dim() < 2:
        raise ValueError(f"pool must be a tensor [num_blocks, *block_shape], got {getattr(pool, 'shape', pool)}")
    check_tensor("block_ids", block_ids, 1, (torch.int32, torch.int64))
    check_tensor("staging", staging, pool.dim(), (pool.dtype,))
    n = block_ids.shape[0]
    if tuple(staging.shape) != (n, *pool.shape[1:]):
        raise ValueError(f"staging shape {tuple(staging.shape)} must be {(n, *pool.shape[1:])}")
    for name, t in (("pool", pool), ("staging", staging)):
        if t.shape[0] and not t[0].is_contiguous():
            raise ValueError(f"{name} blocks must be contiguous payloads, got strides {t.stride()}")
    if block_ids.device.type not in ("cpu", pool.device.type):
        raise ValueError(f"block_ids on {block_ids.device} must be on the CPU or the pool's {pool.device}")
    if block_ids.device.type == "cpu" and n:
        num_blocks = pool.shape[0]
        lo, hi = int(block_ids.min()), int(block_ids.max())
        if lo < 0 or hi >= num_blocks:
            raise ValueError(f"block_ids must lie in [0, {num_blocks}), got min {lo} max {hi}")
        if unique and block_ids.unique().numel() != n:
            raise ValueError(f"block_ids must be distinct for a scatter, got {n} ids with repeats")


def check_dequantize_int8(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Check int8 ``data [n, rows, head_dim]``, float16/float32 ``scales [n, rows]`` and ``out``
    like ``data`` (float32/float16/bfloat16), head_dim contiguous, on one device."""
    check_tensor("data", data, 3, (torch.int8,))
    _check_dequantize(data, scales, out)


def check_dequantize_fp8(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """As ``check_dequantize_int8``, for float8 e4m3fn ``data`` (or its bytes, uint8)."""
    check_tensor("data", data, 3, (torch.float8_e4m3fn, torch.uint8))
    _check_dequantize(data, scales, out)


def _check_dequantize(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    check_tensor("scales", scales, 2, (torch.float16, torch.float32))
    check_tensor("out", out, 3, ATTENTION_DTYPES)
    if tuple(scales.shape) != tuple(data.shape[:2]) or out.shape != data.shape:
        raise ValueError(
            f"data {tuple(data.shape)}, scales {tuple(scales.shape)} and out {tuple(out.shape)} must be "
            "[n, rows, head_dim], [n, rows] and [n, rows, head_dim]"
        )
    for name, t in (("data", data), ("out", out)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
    check_same_device(data=data, scales=scales, out=out)


def device_guard(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Make ``device`` current for a Triton launch (Triton launches on the current CUDA device)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
