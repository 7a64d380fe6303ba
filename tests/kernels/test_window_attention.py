"""Sliding-window attention (``window=W``: a query at position p sees keys ``p - W < q <= p``) in
the references against naive dense attention, and in the Triton kernels (single pass, split-K,
prefill tiles) against the references, on odd shapes. Every position below a window is NaN in
the pool: a kernel that reads it, masked or not, fails (a sliding layer's blocks below its window
may be blocks the store never filled)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import kernels
from kvstore.kernels import reference
from kvstore.kernels.decode_attention import paged_decode_attention
from kvstore.kernels.prefill_attention import paged_prefill_attention

from kernel_testing import (
    BF16_NEEDS_GPU,
    assert_close,
    cu_seqlens,
    dense_attention,
    make_paged_kv,
    poison_below,
    poisoned_like,
    random_queries,
)

LENS = [1, 17, 64, 100, 5, 130]  # one token, odd lengths, block multiples, past a 64-token partition
WINDOWS = [1, 5, 16, 33, 100, 1000]  # one token, odd, a block, past a block, one sequence's whole, past all


def decode_starts(lens: list[int], window: int) -> list[int]:
    return [max(0, n - window) for n in lens]


@pytest.mark.parametrize("window", WINDOWS)
def test_decode_reference_with_a_window_matches_dense(window: int) -> None:
    kv = make_paged_kv(LENS, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, seed=window)
    poison_below(kv, decode_starts(LENS, window))
    q = random_queries(len(LENS), 6, 32, torch.float32)
    out = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.3,
                                           out=poisoned_like(q), window=window)
    for i, n in enumerate(LENS):
        assert_close(out[i], dense_attention(q[i : i + 1], kv, i, n - 1, 0.3, window)[0], f"sequence {i}")


@pytest.mark.parametrize("window", [1, 7, 16, 40])
def test_prefill_reference_with_a_window_matches_dense(window: int) -> None:
    q_lens, context_lens = [1, 6, 0, 20, 45], [0, 11, 9, 16, 3]
    lens = [q + c for q, c in zip(q_lens, context_lens, strict=True)]
    kv = make_paged_kv(lens, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, seed=window)
    poison_below(kv, [max(0, c - window + 1) for c in context_lens])
    q = random_queries(sum(q_lens), 4, 32, torch.float32)
    cu = cu_seqlens(q_lens)
    out = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu, 0.2,
                                            out=poisoned_like(q), window=window)
    for i, (q_len, context_len) in enumerate(zip(q_lens, context_lens, strict=True)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        if q_len:
            assert_close(out[rows], dense_attention(q[rows], kv, i, context_len, 0.2, window), f"sequence {i}")


# (dtype, GQA group, block_size, head_dim)
CASES = [
    (torch.float32, 1, 16, 64),
    (torch.float16, 4, 32, 48),
    (torch.float32, 8, 64, 32),
    pytest.param(torch.bfloat16, 4, 16, 64, marks=BF16_NEEDS_GPU),
]


@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("dtype", "group", "block_size", "head_dim"), CASES)
def test_decode_with_a_window_matches_reference(dtype: torch.dtype, group: int, block_size: int, head_dim: int,
                                                window: int, split: bool) -> None:
    kv = make_paged_kv(LENS, 2, head_dim, block_size, dtype, seed=window + block_size)
    poison_below(kv, decode_starts(LENS, window))
    q = random_queries(len(LENS), 2 * group, head_dim, dtype)
    scale = head_dim**-0.5
    expected = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale,
                                                window=window)
    # 64-token partitions from each window's start: the 130-token sequence spans up to three
    out = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale,
                                 out=poisoned_like(q), split_k=split, partition_size=64, window=window)
    assert_close(out, expected, f"decode window={window} {dtype} group={group} block={block_size} split={split}")


@pytest.mark.parametrize("tiles", [(32, 16), (16, 16), (16, 64)])
@pytest.mark.parametrize("window", [1, 7, 16, 40, 1000])
@pytest.mark.parametrize(("dtype", "group", "block_size", "head_dim"), CASES)
def test_prefill_with_a_window_matches_reference(dtype: torch.dtype, group: int, block_size: int, head_dim: int,
                                                 window: int, tiles: tuple[int, int]) -> None:
    # a lone token with and without a prefix, no new rows, prefixes ending mid-block, a chunk
    # spanning several query tiles, one longer than the window with no prefix
    q_lens, context_lens = [1, 1, 0, 9, 40, 3, 70], [0, 37, 12, 0, 17, 64, 0]
    lens = [q + c for q, c in zip(q_lens, context_lens, strict=True)]
    kv = make_paged_kv(lens, 1, head_dim, block_size, dtype, seed=window * tiles[0])
    poison_below(kv, [max(0, c - window + 1) for c in context_lens])
    q = random_queries(sum(q_lens), group, head_dim, dtype)
    cu = cu_seqlens(q_lens)
    scale = head_dim**-0.5
    expected = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu, scale,
                                                 window=window)
    out = paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu, scale,
                                  out=poisoned_like(q), max_query_len=max(q_lens), block_m=tiles[0],
                                  block_n=tiles[1], window=window)
    assert_close(out, expected, f"prefill window={window} {dtype} group={group} block={block_size} tiles={tiles}")


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    shape=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 50)), min_size=1, max_size=4),
    window=st.integers(1, 60),
    tiles=st.sampled_from([(16, 16), (32, 16), (16, 32)]),
)
def test_prefill_with_a_window_matches_reference_on_random_batches(
    shape: list[tuple[int, int]], window: int, tiles: tuple[int, int]
) -> None:
    q_lens = [q for q, _ in shape]
    lens = [max(q + c, 1) for q, c in shape]
    kv = make_paged_kv(lens, 1, 32, 16, torch.float32, seed=sum(lens) + window)
    poison_below(kv, [max(0, n - q - window + 1) for q, n in zip(q_lens, lens, strict=True)])
    q = random_queries(sum(q_lens), 4, 32, torch.float32)
    cu = cu_seqlens(q_lens)
    expected = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu, 0.2,
                                                 window=window)
    out = paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu, 0.2,
                                  out=poisoned_like(q), block_m=tiles[0], block_n=tiles[1], window=window)
    assert_close(out, expected, f"prefill q_lens={q_lens} lens={lens} window={window} tiles={tiles}")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_the_dispatcher_passes_the_window(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_KERNELS", backend)
    lens = [30, 9]
    kv = make_paged_kv(lens, 1, 32, 16, torch.float32, seed=3)
    poison_below(kv, [19, 0])  # below what the decode rows (22, 1) and the prefill rows (19, 0) see
    q = random_queries(2, 2, 32, torch.float32)
    out = kernels.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2, window=8)
    for i, n in enumerate(lens):
        assert_close(out[i], dense_attention(q[i : i + 1], kv, i, n - 1, 0.2, 8)[0], f"decode {backend} {i}")
    cu = cu_seqlens([4, 2])
    rows = random_queries(6, 2, 32, torch.float32)
    out = kernels.paged_prefill_attention(rows, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu, 0.2,
                                          window=8)
    assert_close(out[:4], dense_attention(rows[:4], kv, 0, 26, 0.2, 8), f"prefill {backend}")


@pytest.mark.parametrize("window", [0, -3, True, 2.0])
def test_a_window_below_one_token_is_refused(window: object) -> None:
    kv = make_paged_kv([5], 1, 32, 16, torch.float32)
    q = random_queries(1, 1, 32, torch.float32)
    for attend in (reference.paged_decode_attention, paged_decode_attention):
        with pytest.raises(ValueError, match="window must be None or an int >= 1"):
            attend(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2, window=window)  # type: ignore[arg-type]
    cu = cu_seqlens([1])
    for prefill in (reference.paged_prefill_attention, paged_prefill_attention):
        with pytest.raises(ValueError, match="window must be None or an int >= 1"):
            prefill(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu, 0.2, window=window)  # type: ignore[arg-type]
