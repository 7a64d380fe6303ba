"""The references against naive dense attention and plain loops, so the references can be trusted."""

from __future__ import annotations

import pytest
import torch

from kvstore.kernels import reference

from kernel_testing import (
    DEVICE,
    assert_close,
    assert_same_bits,
    cu_seqlens,
    dense_attention,
    make_paged_kv,
    poisoned_like,
    random_queries,
)


@pytest.mark.parametrize(("group", "block_size", "dtype"), [(1, 16, torch.float32), (4, 32, torch.float16), (8, 16, torch.float32)])
def test_decode_reference_matches_dense(group: int, block_size: int, dtype: torch.dtype) -> None:
    lens = [1, 17, 40, 32]
    kv = make_paged_kv(lens, num_kv_heads=2, head_dim=32, block_size=block_size, dtype=dtype)
    q = random_queries(len(lens), 2 * group, 32, dtype)
    out = reference.paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.3, out=poisoned_like(q)
    )
    for i, n in enumerate(lens):
        assert_close(out[i], dense_attention(q[i : i + 1], kv, i, n - 1, 0.3)[0], f"sequence {i}")


def test_decode_reference_zero_length_gives_zeros() -> None:
    kv = make_paged_kv([0, 5], num_kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32)
    q = random_queries(2, 2, 16, torch.float32)
    out = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.25)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out[1], dense_attention(q[1:], kv, 1, 4, 0.25)[0], "sequence 1")


@pytest.mark.parametrize(("group", "dtype"), [(1, torch.float32), (4, torch.float16)])
def test_prefill_reference_matches_dense(group: int, dtype: torch.dtype) -> None:
    q_lens, context_lens = [1, 6, 0, 20], [0, 11, 9, 16]
    lens = [q + c for q, c in zip(q_lens, context_lens, strict=True)]
    kv = make_paged_kv(lens, num_kv_heads=2, head_dim=32, block_size=16, dtype=dtype)
    q = random_queries(sum(q_lens), 2 * group, 32, dtype)
    cu = cu_seqlens(q_lens)
    out = reference.paged_prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu, 0.2, out=poisoned_like(q)
    )
    for i, (q_len, context_len) in enumerate(zip(q_lens, context_lens, strict=True)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        if q_len:
            assert_close(out[rows], dense_attention(q[rows], kv, i, context_len, 0.2), f"sequence {i}")


def test_store_kv_reference_matches_loop() -> None:
    kv = make_paged_kv([20, 7], num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float16)
    slots = torch.tensor([5, -1, 33, 2, -1, 70], dtype=torch.int64, device=DEVICE)
    key = random_queries(6, 2, 16, torch.float16, seed=3)
    value = random_queries(6, 2, 16, torch.float16, seed=4)
    expected = kv.pool.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // 16, 1, 0, slot % 16] = key[t]
            expected[slot // 16, 1, 1, slot % 16] = value[t]
    reference.store_kv(key, value, kv.k_cache, kv.v_cache, slots)
    assert_same_bits(kv.pool, expected, "pool")


def test_block_copy_reference_matches_loop() -> None:
    pool = torch.randn((9, 2, 2, 4, 1, 8), device=DEVICE)
    ids = torch.tensor([7, 0, 3], device=DEVICE)
    staging = reference.gather_blocks(pool, ids, poisoned_like(pool[:3]))
    assert_same_bits(staging, torch.stack([pool[7], pool[0], pool[3]]), "gathered")
    fresh = torch.randn_like(staging)
    expected = pool.clone()
    for i, b in enumerate(ids.tolist()):
        expected[b] = fresh[i]
    reference.scatter_blocks(pool, ids, fresh)
    assert_same_bits(pool, expected, "pool")
