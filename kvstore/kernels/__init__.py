"""Attention, block-move and dequantize kernels over the block-major KV pool, with a backend dispatcher.

The pool is ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``; attention and
``store_kv`` take one layer's K and V views (``pool[:, layer, 0]``, ``pool[:, layer, 1]``, each
``[num_blocks, block_size, kv_heads, head_dim]`` and strided), the block copies take the pool.

Dispatch, per call: ``KVSTORE_KERNELS`` (read by ``kernel_backend`` here: the kernels import nothing of the store) =
``reference`` runs ``kvstore.kernels.reference``; ``triton`` runs the Triton kernels (on CPU tensors only
under ``TRITON_INTERPRET=1``); ``auto`` (the default) runs Triton when the tensors are on CUDA and
Triton is installed, else the reference, except that the 8-bit dequantize on the CPU runs the C++
kernel of ``kvstore.kernels.cpu_ext`` once something has loaded it (a store with a quantizing
codec does when it opens; the two agree bit for bit). The Triton modules are imported on first use,
so this package imports without Triton.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import warnings
from types import ModuleType

import torch

from kvstore.kernels import _checks, cpu_ext, reference
from kvstore.kernels.pages import PAGE_CODES, pack_rows, packed_head_dim, page_views, unpack_rows

KERNELS = (  # the public functions that dispatch to Triton or the reference
    "dequantize_fp8",
    "dequantize_int8",
    "gather_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "scatter_blocks",
    "store_kv",
)
__all__ = [
    "KERNELS",
    "PAGE_CODES",
    "dequantize_fp8",
    "dequantize_int8",
    "gather_blocks",
    "kernel_backend",
    "pack_rows",
    "packed_head_dim",
    "page_views",
    "paged_decode_attention",
    "paged_prefill_attention",
    "scatter_blocks",
    "store_kv",
    "unpack_rows",
]


def kernel_backend() -> str:
    """``KVSTORE_KERNELS``: "auto" (Triton on CUDA, reference on CPU), "triton" or "reference"."""
    value = os.environ.get("KVSTORE_KERNELS", "auto").strip().lower() or "auto"
    if value not in ("auto", "triton", "reference"):
        raise ValueError(f"KVSTORE_KERNELS must be auto, triton or reference, got {value!r}")
    return value


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_module(name: str) -> ModuleType:
    if not _has_triton():
        raise RuntimeError(
            "KVSTORE_KERNELS=triton but Triton is not installed: pip install 'kvstore[triton]', "
            "or set KVSTORE_KERNELS=auto or reference"
        )
    return importlib.import_module(f"kvstore.kernels.{name}")


def _use_triton(device: torch.device) -> bool:
    backend = kernel_backend()
    if backend != "auto":
        return backend == "triton"
    if device.type != "cuda":
        return False
    if not _has_triton():
        warnings.warn("CUDA tensors but Triton is not installed: using the torch reference kernels", stacklevel=3)
        return False
    return True


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
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of one new query row per sequence over its paged KV (grouped-query).

    Args:
        q: ``[num_seqs, num_heads, head_dim]``, float32/float16/bfloat16, the cache's dtype;
            ``num_heads`` a multiple of ``kv_heads``; head_dim contiguous.
        k_cache: one layer's K ``[num_blocks, block_size, kv_heads, head_dim]`` (may be strided).
        v_cache: the same layer's V, same shape, dtype and strides.
        block_tables: ``[num_seqs, max_blocks]`` int32; entry j of row i is the block holding
            tokens ``[j * block_size, (j + 1) * block_size)`` of sequence i. Entries past
            ``ceil(seq_len / block_size)`` are never read.
        seq_lens: ``[num_seqs]`` int32 tokens in the cache per sequence, the new one included.
            A length of 0 gives a zero output row.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: optional output like ``q``; written in place and returned.
        max_seq_len: host-side upper bound of ``seq_lens``, sizing the split-K grid without a
            device sync; defaults to ``max_blocks * block_size``.
        split_k: force (True) or forbid (False) the split-K kernel; None picks it for long
            contexts on an under-filled GPU. The reference ignores it.
        k_scales: quantized pages (``PAGE_CODES``): ``k_cache``/``v_cache`` then hold codes
            (int8 or float8_e4m3fn) and ``k_scales``/``v_scales`` ``[num_blocks, block_size,
            kv_heads]`` (float16/float32, may be strided) one scale per token row; each value is
            its code times its row's scale, decoded as it is read (no page is decoded whole).
            ``q`` is then any float dtype.
        v_scales: the V scales, with ``k_scales``.
        window: sliding-window attention: the new token, at position ``seq_len - 1``, sees only
            the last ``window`` positions, ``[seq_len - window, seq_len)`` (its own included,
            as transformers' sliding-window mask); None: every position. Blocks wholly below
            the window are never read (their table entries may be anything in range).

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: a shape, dtype, stride or device does not fit, a window below 1 (on CPU
            also: a length or a used block id out of range).
    """
    if _use_triton(q.device):
        launcher = _triton_module("decode_attention").paged_decode_attention
        return launcher(
            q, k_cache, v_cache, block_tables, seq_lens, scale, out=out, max_seq_len=max_seq_len, split_k=split_k,
            k_scales=k_scales, v_scales=v_scales, window=window,
        )
    return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=out,
                                            k_scales=k_scales, v_scales=v_scales, window=window)


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
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of several sequences' new rows over their cached prefix and themselves.

    The new rows' K/V must already be in the cache (``store_kv`` first). Row r of sequence i
    (``q_len = cu_seqlens_q[i + 1] - cu_seqlens_q[i]`` new rows) sits at absolute position
    ``p = seq_lens[i] - q_len + r`` and attends to positions ``[0, p]``, or with ``window`` to
    ``(p - window, p]``.

    Args:
        q: ``[total_new_tokens, num_heads, head_dim]``, sequences packed one after another.
        k_cache: one layer's K view, as for ``paged_decode_attention``.
        v_cache: the same layer's V view.
        block_tables: ``[num_seqs, max_blocks]`` int32.
        seq_lens: ``[num_seqs]`` int32 total tokens per sequence (cached prefix + new rows).
        cu_seqlens_q: ``[num_seqs + 1]`` int32 row offsets into ``q``: 0, ..., total_new_tokens.
        scale: softmax scale.
        out: optional output like ``q``.
        max_query_len: host-side max of the new-row counts; computing it otherwise syncs.
        k_scales: quantized pages, as for ``paged_decode_attention``.
        v_scales: the V scales, with ``k_scales``.
        window: sliding-window attention, as for ``paged_decode_attention``; None: causal over all.

    Returns:
        ``[total_new_tokens, num_heads, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: as for ``paged_decode_attention``, plus bad ``cu_seqlens_q`` (on CPU: not
            rising from 0 to total_new_tokens, or more new rows than a sequence's length).
    """
    args = (q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale)
    if _use_triton(q.device):
        launcher = _triton_module("prefill_attention").paged_prefill_attention
        return launcher(*args, out=out, max_query_len=max_query_len, k_scales=k_scales, v_scales=v_scales,
                        window=window)
    return reference.paged_prefill_attention(*args, out=out, k_scales=k_scales, v_scales=v_scales, window=window)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    *, k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
) -> None:
    """Write new K/V rows of one layer into their slots.

    Args:
        key: ``[num_tokens, kv_heads, head_dim]`` in the cache's dtype (head_dim contiguous).
        value: same shape as ``key``.
        k_cache: the layer's K view ``[num_blocks, block_size, kv_heads, head_dim]``.
        v_cache: the layer's V view.
        slot_mapping: ``[num_tokens]`` int64, ``slot = block_id * block_size + offset``; -1 skips
            the token. Slots must be distinct.
        k_scales: quantized pages (see ``paged_decode_attention``): each new row (any float
            dtype) is quantized as it is written, one scale per (token, head) row: amax / QMAX
            (127 for int8, 448 for float8_e4m3fn) rounded up to the scale dtype, so no value
            clips; the codes go to the cache, the scales here. ``reference.quantize_rows`` is
            the definition.
        v_scales: the V scales, with ``k_scales``.

    Raises:
        ValueError: a shape, dtype or device does not fit (on CPU also: a slot out of range).
    """
    if _use_triton(k_cache.device):
        return _triton_module("cache_write").store_kv(key, value, k_cache, v_cache, slot_mapping,
                                                       k_scales=k_scales, v_scales=v_scales)
    return reference.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scales=k_scales, v_scales=v_scales)


def gather_blocks(pool: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy whole blocks out of the pool in one launch: ``out[i] = pool[block_ids[i]]``.

    Args:
        pool: ``[num_blocks, *block_shape]``, each block a contiguous payload.
        block_ids: ``[n]`` int32/int64, on the CPU or the pool's device.
        out: optional ``[n, *block_shape]`` staging buffer of the pool's dtype: on the pool's
            device or, for a CUDA pool, pinned host memory. Allocated on the pool's device if None.

    Returns:
        ``out``.

    Raises:
        ValueError: shapes, dtypes or devices do not fit; on CPU ids also: an id out of range.
    """
    if _use_triton(pool.device):
        return _triton_module("block_copy").gather_blocks(pool, block_ids, out)
    return reference.gather_blocks(pool, block_ids, out)


def scatter_blocks(pool: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Copy whole blocks into the pool in one launch: ``pool[block_ids[i]] = src[i]``.

    Args:
        pool: ``[num_blocks, *block_shape]``, each block a contiguous payload.
        block_ids: ``[n]`` distinct int32/int64 ids, on the CPU or the pool's device.
        src: ``[n, *block_shape]`` on the pool's device or (CUDA pool) in pinned host memory.

    Raises:
        ValueError: as for ``gather_blocks``, plus repeated ids (checked for CPU ids).
    """
    if _use_triton(pool.device):
        return _triton_module("block_copy").scatter_blocks(pool, block_ids, src)
    return reference.scatter_blocks(pool, block_ids, src)


def dequantize_int8(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Decode int8 rows with one scale per row: ``out[b, r, :] = data[b, r, :] * scales[b, r]``.

    The product is formed in float32 and rounded once to ``out``'s dtype (the int8 codec's
    decode; ``data`` and ``scales`` are usually strided views of encoded blocks).

    Args:
        data: ``[n, rows, head_dim]`` int8, head_dim contiguous (other strides free).
        scales: ``[n, rows]`` float16 or float32.
        out: ``[n, rows, head_dim]`` float32/float16/bfloat16, head_dim contiguous.

    Returns:
        ``out``.

    Raises:
        ValueError: a shape, dtype, stride or device does not fit.
    """
    if _use_triton(out.device):
        return _triton_module("dequant").dequantize_int8(data, scales, out)
    if _cpp_dequantize(data, scales, out, fp8=False):
        return out
    return reference.dequantize_int8(data, scales, out)


def dequantize_fp8(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Decode float8 e4m3fn rows with one scale per row: ``out[b, r, :] = data[b, r, :] * scales[b, r]``.

    As ``dequantize_int8`` (the product in float32, rounded once into ``out``), for the fp8
    codec's elements: ``data`` is ``[n, rows, head_dim]`` float8_e4m3fn, or its bytes as uint8.
    """
    if _use_triton(out.device):
        return _triton_module("dequant").dequantize_fp8(data, scales, out)
    if _cpp_dequantize(data, scales, out, fp8=True):
        return out
    return reference.dequantize_fp8(data, scales, out)


def _cpp_dequantize(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, fp8: bool) -> bool:
    """Run the C++ dequantize where it applies (CPU tensors, ``auto``, the module loaded)."""
    if out.device.type != "cpu" or kernel_backend() != "auto":
        return False
    module = cpu_ext.loaded()
    if module is None:
        return False
    (_checks.check_dequantize_fp8 if fp8 else _checks.check_dequantize_int8)(data, scales, out)
    module.dequantize(data.view(torch.uint8), scales, out, fp8)
    return True
