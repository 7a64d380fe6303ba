"""Triton gather_blocks / scatter_blocks against the reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvstore.kernels import reference
from kvstore.kernels.block_copy import _word_size, gather_blocks, scatter_blocks

from kernel_testing import DEVICE, assert_same_bits

# Block shapes whose byte sizes are multiples of 8, of 2 only (3 fp16 elements), and of 4.
SHAPES = [
    (torch.float16, (2, 2, 16, 2, 64)),
    (torch.float16, (1, 1, 1, 1, 3)),
    (torch.float32, (3, 2, 4, 1, 5)),
    (torch.bfloat16, (2, 2, 16, 1, 16)),
]


def _random_pool(num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *block_shape), generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize(("dtype", "block_shape"), SHAPES)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_gather_and_scatter_match_reference(dtype: torch.dtype, block_shape: tuple[int, ...], ids_dtype: torch.dtype) -> None:
    pool = _random_pool(11, block_shape, dtype, seed=1)
    ids = torch.tensor([9, 0, 4, 10, 5], dtype=ids_dtype)  # shuffled, non-contiguous, first and last
    staging = torch.full((5, *block_shape), float("nan"), dtype=dtype, device=DEVICE)
    gather_blocks(pool, ids, staging)
    assert_same_bits(staging, reference.gather_blocks(pool, ids), f"gather {dtype} {block_shape}")

    fresh = _random_pool(5, block_shape, dtype, seed=2)
    expected = pool.clone()
    reference.scatter_blocks(expected, ids, fresh)
    scatter_blocks(pool, ids.to(DEVICE), fresh)  # ids on the pool's device: no range check
    assert_same_bits(pool, expected, f"scatter {dtype} {block_shape}")


def test_gather_allocates_and_copies_from_strided_pool() -> None:
    # Every other block of a bigger pool: blocks stay contiguous, the pool stride does not.
    base = _random_pool(12, (2, 2, 4, 1, 8), torch.float32, seed=3)
    pool = base[::2]
    ids = torch.tensor([5, 2], dtype=torch.int64)
    assert_same_bits(gather_blocks(pool, ids), torch.stack([base[10], base[4]]), "strided gather")
    assert _word_size(pool) == 8


def test_empty_id_list_copies_nothing() -> None:
    pool = _random_pool(3, (2, 4), torch.float16, seed=4)
    out = gather_blocks(pool, torch.empty(0, dtype=torch.int64))
    assert out.shape == (0, 2, 4)
    scatter_blocks(pool, torch.empty(0, dtype=torch.int64), out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_gather_and_scatter_through_pinned_host_memory() -> None:
    pool = _random_pool(64, (4, 2, 16, 8, 128), torch.float16, seed=5)
    ids = torch.randperm(64)[:17]
    staging = torch.empty((17, *pool.shape[1:]), dtype=pool.dtype).pin_memory()
    gather_blocks(pool, ids, staging)
    torch.cuda.synchronize()
    assert_same_bits(staging, pool[ids.to(DEVICE)], "gather to pinned")
    fresh = torch.randn(staging.shape).to(pool.dtype).pin_memory()
    expected = pool.clone()
    expected[ids.to(DEVICE)] = fresh.to(DEVICE)
    scatter_blocks(pool, ids, fresh)
    torch.cuda.synchronize()
    assert_same_bits(pool, expected, "scatter from pinned")
