"""Copy a list of whole blocks between the pool and a contiguous staging buffer, in Triton.

``gather``: ``staging[i] = pool[block_ids[i]]``; ``scatter``: ``pool[block_ids[i]] = staging[i]``.
Each block is one contiguous payload, so a copy is a stream of machine words: both sides are
viewed as ``[n, words_per_block]`` of the widest integer word that divides the block and the
alignment. On CUDA the staging buffer may be pinned host memory: the kernel then reads or
writes it in place over the bus (pinned pages are mapped into the device's address space).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.kernels import _checks

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_CHUNK = 4096  # words per program (32 KiB of int64)


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, ids_ptr, stride_src, stride_dst, words_per_block,
    GATHER: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    block = tl.load(ids_ptr + i).to(tl.int64)  # int64 rows: a pool may exceed 2**31 words
    if GATHER:
        src_row = block
        dst_row = i
    else:
        src_row = i
        dst_row = block
    offs = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < words_per_block
    words = tl.load(src_ptr + src_row * stride_src + offs, mask=mask)
    tl.store(dst_ptr + dst_row * stride_dst + offs, words, mask=mask)


def _word_size(*tensors: torch.Tensor) -> int:
    """The widest word (bytes) dividing every block, block stride and base address."""
    for size in (8, 4, 2, 1):
        if all(
            (t[0].numel() * t.element_size()) % size == 0
            and (t.stride(0) * t.element_size()) % size == 0
            and t.data_ptr() % size == 0
            for t in tensors
        ):
            return size
    raise AssertionError("unreachable: one byte divides everything")


def _as_words(t: torch.Tensor, size: int) -> torch.Tensor:
    return t.flatten(1).view(torch.uint8).view(_WORD_DTYPES[size])


def _copy(pool: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, gather: bool) -> None:
    _checks.check_block_copy(pool, block_ids, staging, unique=not gather)
    _checks.check_launchable(_copy_blocks_kernel, pool.device)
    if staging.device != pool.device and not (staging.device.type == "cpu" and staging.is_pinned()):
        raise ValueError(f"staging on {staging.device} must be on {pool.device} or in pinned host memory")
    n = block_ids.shape[0]
    if n == 0 or pool[0].numel() == 0:
        return
    size = _word_size(pool, staging)
    pool_words, staging_words = _as_words(pool, size), _as_words(staging, size)
    words_per_block = pool_words.shape[1]
    chunk = min(_CHUNK, triton.next_power_of_2(words_per_block))
    num_chunks = triton.cdiv(words_per_block, chunk)
    if num_chunks > 65535:  # CUDA's limit on the second grid axis
        raise ValueError(f"a block of {words_per_block} words needs {num_chunks} chunks; at most 65535")
    ids = block_ids.to(pool.device)
    src, dst = (pool_words, staging_words) if gather else (staging_words, pool_words)
    with _checks.device_guard(pool.device):
        _copy_blocks_kernel[(n, num_chunks)](
            src, dst, ids, src.stride(0), dst.stride(0), words_per_block, GATHER=gather, CHUNK=chunk, num_warps=4
        )


def gather_blocks(pool: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launcher of ``kernels.gather_blocks``."""
    if out is None:
        out = torch.empty((block_ids.shape[0], *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    _copy(pool, block_ids, out, gather=True)
    return out


def scatter_blocks(pool: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Triton launcher of ``kernels.scatter_blocks``."""
    _copy(pool, block_ids, src, gather=False)
