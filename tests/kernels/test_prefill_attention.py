"""Triton paged prefill attention against the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.kernels import reference
from kvstore.kernels.prefill_attention import paged_prefill_attention

from kernel_testing import (
    BF16_NEEDS_GPU,
    DEVICE,
    assert_close,
    cu_seqlens,
    make_paged_kv,
    poisoned_like,
    random_queries,
)

# (new rows, cached prefix) per sequence: a lone token with and without a prefix, a sequence
# with no new rows, prefixes that end mid-block, and one spanning two 32-row query tiles.
Q_LENS = [1, 1, 0, 9, 40, 3]
CONTEXT_LENS = [0, 37, 12, 0, 17, 64]

CASES = [
    (torch.float32, 1, 16, 64),
    (torch.float16, 4, 32, 64),
    (torch.float16, 8, 16, 32),
    (torch.float32, 4, 64, 48),
    pytest.param(torch.bfloat16, 4, 16, 64, marks=BF16_NEEDS_GPU),
]


@pytest.mark.parametrize(("dtype", "group", "block_size", "head_dim"), CASES)
def test_prefill_matches_reference(dtype: torch.dtype, group: int, block_size: int, head_dim: int) -> None:
    lens = [q + c for q, c in zip(Q_LENS, CONTEXT_LENS, strict=True)]
    kv = make_paged_kv(lens, 1, head_dim, block_size, dtype, seed=group * block_size)
    q = random_queries(sum(Q_LENS), group, head_dim, dtype)
    cu = cu_seqlens(Q_LENS)
    scale = head_dim**-0.5
    expected = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu, scale)
    # 32-row query tiles and 16-key tiles: many tiles per sequence, both masked and unmasked.
    out = paged_prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu, scale,
        out=poisoned_like(q), max_query_len=max(Q_LENS), block_m=32, block_n=16,
    )  # fmt: skip
    assert_close(out, expected, f"prefill {dtype} group={group} block={block_size} dim={head_dim}")


def test_prefill_default_tiles_two_kv_heads_strided_q() -> None:
    q_lens, context_lens = [70, 1, 5], [0, 30, 100]
    lens = [q + c for q, c in zip(q_lens, context_lens, strict=True)]
    kv = make_paged_kv(lens, 2, 64, 16, torch.float16, seed=5)
    qkv = random_queries(sum(q_lens), 4 + 2 + 2, 64, torch.float16)
    q = qkv[:, :4]
    cu = cu_seqlens(q_lens)
    expected = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu, 0.1)
    # max_query_len left out: the launcher derives it from cu_seqlens_q.
    out = paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu, 0.1)
    assert_close(out, expected, "prefill default tiles")


def test_prefill_without_prefix_is_plain_causal_attention() -> None:
    kv = make_paged_kv([23], 1, 32, 16, torch.float32, seed=9)
    q = random_queries(23, 2, 32, torch.float32)
    keys = kv.k_cache[kv.block_tables[0, :2].long()].flatten(0, 1)[:23].float()
    values = kv.v_cache[kv.block_tables[0, :2].long()].flatten(0, 1)[:23].float()
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1).expand(2, -1, -1), values.transpose(0, 1).expand(2, -1, -1),
        is_causal=True, scale=0.3,
    ).transpose(0, 1)  # fmt: skip
    cu = torch.tensor([0, 23], dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu, 0.3, block_m=16, block_n=16)
    assert_close(out, expected, "causal")


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    shape=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 50)), min_size=1, max_size=4),
    group=st.sampled_from([1, 4, 8]),
    block_size=st.sampled_from([16, 32]),
    tiles=st.sampled_from([(16, 16), (32, 16), (16, 32)]),
)
def test_prefill_matches_reference_on_random_batches(
    shape: list[tuple[int, int]], group: int, block_size: int, tiles: tuple[int, int]
) -> None:
    q_lens = [q for q, _ in shape]
    lens = [max(q + c, 1) for q, c in shape]
    kv = make_paged_kv(lens, 1, 32, block_size, torch.float32, seed=sum(lens))
    q = random_queries(sum(q_lens), group, 32, torch.float32)
    cu = cu_seqlens(q_lens)
    expected = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu, 0.2)
    out = paged_prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu, 0.2,
        out=poisoned_like(q), block_m=tiles[0], block_n=tiles[1],
    )  # fmt: skip
    assert_close(out, expected, f"prefill q_lens={q_lens} lens={lens} group={group} tiles={tiles}")
