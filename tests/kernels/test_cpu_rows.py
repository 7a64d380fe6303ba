"""The CPU decode kernel (kvstore/kernels/cpu_rows.py, csrc/row_attention.cpp) against plain
torch in float64: groups over shared rows and sequences alone, every length, row ids anywhere
in a strided pool; its input checks; and what happens where it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from kvstore.engine import LLMEngine, SamplingParams
from kvstore.engine.attention import row_view
from kvstore.kernels import cpu_rows
from tests.factories import require


@pytest.fixture(scope="module")
def built() -> None:
    require(cpu_rows.load(), "the CPU decode kernel did not build (a C++ compiler and ninja on the PATH)")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[list[int]], scale: float) -> torch.Tensor:
    """float64 attention of each sequence's ``q[s]`` over the rows ``rows[s]`` of ``k``/``v``."""
    out = []
    for s, ids in enumerate(rows):
        keys, values = k[ids].double(), v[ids].double()  # [n, heads, dim]
        weights = torch.softmax(torch.einsum("hgd,nhd->hgn", q[s].double(), keys) * scale, dim=-1)
        out.append(torch.einsum("hgn,nhd->hgd", weights, values))
    return torch.stack(out)


def index(groups: list[tuple[list[int], list[int]]], own: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """row_attention's index tensors from ``(members, shared rows)`` items and each sequence's own rows."""
    def padded(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(1, *(len(x) for x in lists))
        return (torch.tensor([x + [0] * (width - len(x)) for x in lists], dtype=torch.long),
                torch.tensor([len(x) for x in lists], dtype=torch.long))

    own_rows, own_lens = padded(own)
    members, counts = padded([m for m, _ in groups])
    shared_rows, shared_lens = padded([r for _, r in groups])
    return own_rows, own_lens, members, counts, shared_rows, shared_lens


@pytest.mark.usefixtures("built")
# head dims: multiples of 32, 8 (a short last chunk of the vector path) and none (the scalar path)
@pytest.mark.parametrize("kv_heads,group,dim", [(2, 2, 64), (3, 3, 64), (1, 4, 16), (4, 1, 128), (1, 4, 256),
                                                (2, 3, 40), (1, 2, 12)])
def test_groups_and_sequences_alone_match_torch(kv_heads: int, group: int, dim: int) -> None:
    g = torch.Generator().manual_seed(kv_heads * 100 + dim)
    layers, bs, num_blocks = 3, 16, 40
    pool = torch.randn((num_blocks, layers, 2, bs, kv_heads, dim), generator=g)
    k, v = row_view(pool[:, 1, 0]), row_view(pool[:, 1, 1])  # a middle layer: rows strided by the block
    rows_per_block = pool.stride(0) // pool.stride(3)

    def rows_of(blocks: list[int], n: int) -> list[int]:
        return [blocks[p // bs] * rows_per_block + p % bs for p in range(n)]

    shared_a = rows_of([5, 17, 2, 30, 8, 3, 36, 1, 27], 131)  # a group of three over 9 blocks, out of order
    # in the pool, over two tiles of 64 rows and a part of one
    shared_b = rows_of([9], 16)
    own = [rows_of([11], 1), rows_of([12, 13], 20), rows_of([14], 7),  # group a: 1, 20 and 7 own rows
           rows_of([20, 21, 22], 33),  # alone: 33 rows, no shared ones
           rows_of([23], 5), rows_of([24], 16)]  # group b
    groups = [([0, 1, 2], shared_a), ([3], []), ([5, 4], shared_b)]  # members in any order
    q = torch.randn((len(own), kv_heads, group, dim), generator=g)
    scale = dim ** -0.5
    out = cpu_rows.row_attention(q, k, v, *index(groups, own), scale)
    whole = [shared_a + own[0], shared_a + own[1], shared_a + own[2], own[3], shared_b + own[4], shared_b + own[5]]
    torch.testing.assert_close(out.double(), reference(q, k, v, whole, scale), atol=2e-6, rtol=1e-5)


@pytest.mark.usefixtures("built")
def test_scores_far_apart_and_long_contexts_stay_exact() -> None:
    # large scores (a softmax dominated by one row, others underflowing) over 2,000 rows
    g = torch.Generator().manual_seed(1)
    rows, heads, dim = 2048, 2, 64
    k = torch.randn((rows, heads, dim), generator=g) * 4
    v = torch.randn((rows, heads, dim), generator=g)
    q = torch.randn((2, heads, 2, dim), generator=g) * 4
    own = [list(range(0, 2000)), list(range(2047, 1000, -1))]
    out = cpu_rows.row_attention(q, k, v, *index([([0], []), ([1], [])], own), 1.0)
    torch.testing.assert_close(out.double(), reference(q, k, v, own, 1.0), atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("built")
def test_bad_inputs_are_refused_with_what_is_wrong() -> None:
    k = v = torch.zeros((32, 2, 8))
    q = torch.zeros((2, 2, 1, 8))
    ok = index([([0, 1], [0, 1])], [[2], [3, 4]])

    def call(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, idx: tuple[torch.Tensor, ...] = ok) -> None:
        cpu_rows.row_attention(q, k, v, *idx, 0.5)

    call()  # the baseline is fine
    with pytest.raises(ValueError, match="q must be a contiguous float32"):
        call(q=q.half())
    with pytest.raises(ValueError, match="k and v must be float32 row views"):
        call(k=torch.zeros((32, 3, 8)))
    with pytest.raises(ValueError, match="own_rows\\[1, 1\\] = 32 is outside the 32 rows"):
        call(idx=index([([0, 1], [0, 1])], [[2], [3, 32]]))
    with pytest.raises(ValueError, match="shared_rows\\[0, 0\\] = -1 is outside"):
        call(idx=index([([0, 1], [-1])], [[2], [3]]))
    with pytest.raises(ValueError, match="own_rows length 0 = 0 is outside"):
        call(idx=index([([0, 1], [0])], [[], [3]]))
    with pytest.raises(ValueError, match="sequence 1 is in 0 items"):
        call(idx=index([([0], [0])], [[2], [3]]))
    with pytest.raises(ValueError, match="sequence 0 is in 2 items"):
        call(idx=index([([0, 1], [0]), ([0], [])], [[2], [3]]))
    with pytest.raises(ValueError, match="members\\[0, 1\\] = 2 is outside the 2 sequences"):
        call(idx=index([([0, 2], [0])], [[2], [3]]))


TINY = dict(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16,
            vocab_size=64)
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.mark.usefixtures("built")
def test_the_kernel_is_loaded_when_the_engine_starts_never_in_a_request() -> None:
    cpu_rows.load.cache_clear()
    llm = LLMEngine(None, random_model=TINY, kv_cache_bytes=1 << 20, host_bytes=0)
    try:
        assert llm.runner.row_kernel
        assert cpu_rows.load.cache_info().misses == 1  # built (or found built) at start
        assert len(llm.generate([[1, 2, 3], [1, 2, 4]], GREEDY)[0].token_ids) == 3
        assert cpu_rows.load.cache_info().misses == 1  # the requests' steps only used it
        assert cpu_rows.load.cache_info().hits > 0
    finally:
        llm.close()


def test_without_a_compiler_the_engine_keeps_the_torch_path(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no c++, no ninja
    cpu_rows.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kvstore.kernels"):
            assert cpu_rows.load() is None
            llm = LLMEngine(None, random_model=TINY, kv_cache_bytes=1 << 20, host_bytes=0)
        try:
            assert not llm.runner.row_kernel
            assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 3
        finally:
            llm.close()
        assert "not on the PATH" in caplog.text and "torch path" in caplog.text
        with pytest.raises(RuntimeError, match="not built"):
            cpu_rows.row_attention(torch.zeros((1, 1, 1, 8)), torch.zeros((4, 1, 8)), torch.zeros((4, 1, 8)),
                                   *index([([0], [])], [[0]]), 1.0)
    finally:
        cpu_rows.load.cache_clear()  # the next caller builds (or finds) the real kernel again
