"""Triton paged decode attention (single pass and split-K) against the reference."""

from __future__ import annotations

import pytest
import torch

from kvstore.kernels import reference
from kvstore.kernels.decode_attention import _should_split, paged_decode_attention

from kernel_testing import BF16_NEEDS_GPU, DEVICE, assert_close, make_paged_kv, poisoned_like, random_queries

LENS = [1, 17, 64, 100, 5]  # one token, odd lengths, an exact multiple of every block size

# (dtype, GQA group, block_size, head_dim): every value of each axis appears at least once.
CASES = [
    (torch.float32, 1, 16, 64),
    (torch.float16, 4, 16, 128),
    (torch.float32, 8, 32, 64),
    (torch.float16, 8, 64, 32),
    (torch.float16, 1, 32, 80),  # head_dim a multiple of 16 but not a power of two
    (torch.float32, 4, 64, 128),
    pytest.param(torch.bfloat16, 4, 16, 64, marks=BF16_NEEDS_GPU),
]


@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
@pytest.mark.parametrize(("dtype", "group", "block_size", "head_dim"), CASES)
def test_decode_matches_reference(dtype: torch.dtype, group: int, block_size: int, head_dim: int, split: bool) -> None:
    num_kv_heads = 2
    kv = make_paged_kv(LENS, num_kv_heads, head_dim, block_size, dtype, seed=group + block_size)
    q = random_queries(len(LENS), num_kv_heads * group, head_dim, dtype)
    scale = head_dim**-0.5
    expected = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    # 64-token partitions: the 100-token sequence spans two, the others one; the grid is sized
    # by the table width, so most programs find an empty partition.
    out = paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale,
        out=poisoned_like(q), split_k=split, partition_size=64,
    )  # fmt: skip
    assert_close(out, expected, f"decode {dtype} group={group} block={block_size} dim={head_dim} split={split}")


def test_decode_strided_q_and_out_and_explicit_max_len() -> None:
    # q as a slice of a fused qkv projection, out as a slice of a wider buffer.
    kv = make_paged_kv([3, 40, 129], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16, seed=7)
    qkv = random_queries(3, 8 + 2 + 2, 64, torch.float16)
    q = qkv[:, :8]
    wide = torch.full((3, 10, 64), float("nan"), dtype=torch.float16, device=DEVICE)
    expected = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    for split in (False, True):
        out = paged_decode_attention(
            q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125,
            out=wide[:, 1:9], max_seq_len=129, split_k=split, partition_size=64,
        )  # fmt: skip
        assert out.data_ptr() == wide[:, 1:9].data_ptr()
        assert_close(out, expected, f"strided split={split}")
        assert torch.isnan(wide[:, 0]).all() and torch.isnan(wide[:, 9]).all(), "wrote outside out"


def test_decode_zero_length_sequence_gives_zeros() -> None:
    kv = make_paged_kv([0, 9], num_kv_heads=1, head_dim=32, block_size=16, dtype=torch.float32)
    q = random_queries(2, 4, 32, torch.float32)
    for split in (False, True):
        out = paged_decode_attention(
            q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2,
            out=poisoned_like(q), split_k=split, partition_size=64,
        )  # fmt: skip
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        expected = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2)
        assert_close(out, expected, f"zero length split={split}")


def test_split_is_never_picked_off_cuda_nor_for_short_contexts() -> None:
    assert not _should_split(1, 100, torch.device("cpu"))
    assert not _should_split(1, 3, torch.device("cuda"))  # under 4 partitions: no device query needed
