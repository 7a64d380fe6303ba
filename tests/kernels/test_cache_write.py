"""Triton store_kv against the reference: the whole pool must come out bit-identical."""

from __future__ import annotations

import pytest
import torch

from kvstore.kernels import reference
from kvstore.kernels.cache_write import store_kv

from kernel_testing import DEVICE, assert_same_bits, make_paged_kv, random_queries


@pytest.mark.parametrize(
    ("dtype", "num_kv_heads", "head_dim", "block_size"),
    [(torch.float32, 1, 64, 16), (torch.float16, 8, 128, 32), (torch.bfloat16, 3, 80, 64)],
)
def test_store_kv_matches_reference(dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    kv = make_paged_kv([5, 40], num_kv_heads, head_dim, block_size, dtype, seed=head_dim)
    num_slots = kv.pool.shape[0] * block_size
    gen = torch.Generator().manual_seed(1)
    # Shuffled distinct slots across the pool, the last one included, with padding tokens (-1).
    slots = torch.randperm(num_slots, generator=gen)[:12]
    slots[0] = num_slots - 1
    slots[[3, 7]] = -1
    slots = slots.to(DEVICE)
    # key/value as slices of a fused qkv projection: token stride wider than heads * head_dim.
    qkv = random_queries(12, 2 + 2 * num_kv_heads, head_dim, dtype, seed=2)
    key, value = qkv[:, 2 : 2 + num_kv_heads], qkv[:, 2 + num_kv_heads :]
    expected = kv.pool.clone()
    reference.store_kv(key, value, expected[:, 1, 0], expected[:, 1, 1], slots)
    store_kv(key, value, kv.k_cache, kv.v_cache, slots)
    assert_same_bits(kv.pool, expected, f"pool after store_kv {dtype}")


def test_store_kv_with_no_tokens_is_a_no_op() -> None:
    kv = make_paged_kv([3], 2, 16, 16, torch.float16)
    before = kv.pool.clone()
    empty = torch.empty((0, 2, 16), dtype=torch.float16, device=DEVICE)
    store_kv(empty, empty, kv.k_cache, kv.v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert_same_bits(kv.pool, before, "pool")
