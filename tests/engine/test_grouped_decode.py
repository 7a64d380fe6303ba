"""Decoding sequences that share a cached prefix read its K/V once per step (kvstore/engine/decode_parts.py,
read_plan.py, ``shared_prefixes``): attention over the shared rows and over each sequence's own rows, merged by
their log-sum-exps (torch's path) or under one softmax (the CPU decode kernel), equals attention
over each sequence's whole context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import kvstore.engine.attention as attention
import kvstore.engine.decode_parts as decode_parts
from kvstore.engine.attention import StepPlan, row_view
from kvstore.engine.decode_parts import GROUP_MIN_ROWS, by_length, shared_prefixes
from kvstore.kernels import cpu_rows
from tests.engine.conftest import GREEDY, hf_greedy_check, make_engine
from tests.factories import require


def test_groups_are_sequences_whose_tables_start_alike() -> None:
    bs = 16
    long = GROUP_MIN_ROWS // bs + 1  # a shared prefix of this many blocks pays between two sequences
    prefix = list(range(100, 100 + long))
    tables = [[*prefix, 1, 2], [*prefix, 3], [*prefix[:-1], 4, 5], [7, 8], [9, *prefix]]
    lens = [(long + 2) * bs, long * bs + 1, (long + 1) * bs, 2 * bs, (long + 1) * bs]
    # 0, 1 and 2 begin with the same blocks; 2 leaves the others at the prefix's last block
    assert shared_prefixes(tables, lens, bs) == [([0, 1, 2], prefix[:-1])]
    # each member keeps a row of its own: a member whose last token ends the prefix stops it a block early
    assert shared_prefixes([prefix, [*prefix, 1]], [long * bs, long * bs + 1], bs) == [([0, 1], prefix[:-1])]
    # too few rows saved: no group
    assert shared_prefixes([[1, 2], [1, 3]], [2 * bs, 2 * bs], bs) == []
    assert shared_prefixes([[*prefix, 1]], [(long + 1) * bs], bs) == []  # one sequence alone


def test_sequences_of_very_different_lengths_attend_in_separate_parts() -> None:
    assert by_length([10, 9, 6, 5]) == [[0, 1, 2, 3]]  # within 2x: one part, in order
    assert by_length([1000, 40, 35, 900, 1]) == [[0, 3], [1, 2], [4]]
    assert by_length([]) == []


@pytest.mark.parametrize("dtype,row_kernel", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=["float32", "bfloat16", "float32-row-kernel"])
def test_attention_in_groups_equals_attention_over_each_whole_context(dtype: torch.dtype, row_kernel: bool) -> None:
    if row_kernel:
        require(cpu_rows.load(), "the CPU decode kernel did not build")
    g = torch.Generator().manual_seed(0)
    bs, kv_heads, group, dim, num_blocks = 4, 2, 3, 8, 120
    pool = torch.randn((num_blocks, 1, 2, bs, kv_heads, dim), generator=g).to(dtype)
    shared = list(range(10, 10 + GROUP_MIN_ROWS // bs))  # one group of 3, with one sequence apart
    tables = [[*shared, 90, 91], [*shared, 92], [*shared, 93, 94, 95], [96, 97, 98]]
    lens = [len(shared) * bs + 6, len(shared) * bs + 1, len(shared) * bs + 9, 10]
    d = len(lens)
    q = torch.randn((d, kv_heads * group, dim), generator=g).to(dtype)
    k_new = torch.randn((d, kv_heads, dim), generator=g).to(dtype)
    v_new = torch.randn((d, kv_heads, dim), generator=g).to(dtype)
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens, strict=True)])
    step = StepPlan(slots, tables, lens, [], bs, pool.stride(0) // pool.stride(3), torch.device("cpu"),
                    row_kernel=row_kernel)
    plan = step.reads[None]
    assert [(m.tolist(), r.numel()) for m, r in plan.decode_groups] == [([0, 1, 2], len(shared) * bs)]
    if row_kernel:  # one kernel call: the group's items and the sequence alone, each its own lengths
        assert plan.row_index is not None and not plan.decode_parts
        own_rows, own_lens, members, counts, shared_rows, shared_lens = plan.row_index
        assert own_lens.tolist() == [6, 1, 9, 10] and counts.tolist() == [3, 1]
        assert members[0].tolist() == [0, 1, 2] and members[1, 0] == 3 and shared_lens.tolist() == [len(shared) * bs, 0]
        assert torch.equal(shared_rows[0, : len(shared) * bs], plan.decode_groups[0][1])
        # sequence 1's one own row is its last token's slot, past the shared blocks
        assert own_rows[1, 0] == tables[1][len(shared)] * (pool.stride(0) // pool.stride(3))
    else:  # own rows 6, 1, 9 and 10: the one-row sequence apart from the others
        assert [None if p.index is None else p.index.tolist() for p in plan.decode_parts] == [[0, 2, 3], [1]]
    k_rows, v_rows = row_view(pool[:, 0, 0]), row_view(pool[:, 0, 1])
    out = step.attend(q, k_new, v_new, k_rows, v_rows, scale=dim ** -0.5)
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):  # float64, each context whole
        pos = torch.arange(n)
        blocks = torch.tensor(table)[pos // bs]
        keys = pool[blocks, 0, 0, pos % bs].double()  # [n, kv_heads, dim], the new row written
        values = pool[blocks, 0, 1, pos % bs].double()
        torch.testing.assert_close(keys[-1], k_new[i].double())
        queries = q[i].double().view(kv_heads, group, dim)
        weights = torch.softmax(torch.einsum("hgd,nhd->hgn", queries, keys) * dim ** -0.5, dim=-1)
        want = torch.einsum("hgn,nhd->hgd", weights, values).reshape(kv_heads * group, dim)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_batch_over_one_cached_prefix_decodes_as_each_sequence_alone(hf_llama: tuple[Any, Path],
                                                                       kv_cache_dtype: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    model, path = hf_llama
    prefix = [(7 * i) % 120 + 3 for i in range(100)]  # 25 blocks of 4, read by 4 sequences
    prompts = [[*prefix, 10 + i, 20 + i, 30 + i] for i in range(4)]
    formed: list[int] = []
    real = attention.shared_prefixes

    def spy(*args: Any) -> Any:
        groups = real(*args)
        formed.extend(len(members) for members, _ in groups)
        return groups

    monkeypatch.setattr(attention, "shared_prefixes", spy)
    llm = make_engine(path, kv_cache_dtype=kv_cache_dtype)
    try:
        # a float32 pool decodes through the CPU kernel (groups in the same call), int8 pages through torch
        assert llm.runner.row_kernel == (kv_cache_dtype == "auto" and cpu_rows.load() is not None)
        llm.generate([prefix], GREEDY)  # the prefix cached, so the batch's prompts share its blocks
        together = llm.generate(prompts, GREEDY)
        assert formed and max(formed) == 4, "the batch's decode steps never read the prefix as one group"
        monkeypatch.setattr(decode_parts, "GROUP_MIN_ROWS", 1 << 30)  # no groups: each sequence reads it all
        apart = llm.generate(prompts, GREEDY)
        llm.check_integrity()
    finally:
        llm.close()
    for prompt, a, b in zip(prompts, together, apart, strict=True):
        assert a.token_ids == b.token_ids
        if kv_cache_dtype == "auto":
            hf_greedy_check(model, prompt, a.token_ids)


def dense_windowed(pool: torch.Tensor, table: list[int], n: int, queries: torch.Tensor, bs: int,
                   window: int | None, first_pos: int) -> torch.Tensor:
    """float64 attention of ``queries`` ``[rows, kv_heads, group, dim]`` (row r at first_pos + r)
    over one sequence's pool rows, each row over ``(p - window, p]``."""
    pos = torch.arange(n)
    blocks = torch.tensor(table)[pos // bs]
    # (rows outside every window are NaN in the pool: zero here, so that masking them out is exact)
    keys = pool[blocks, 0, 0, pos % bs].double().nan_to_num(0.0)
    values = pool[blocks, 0, 1, pos % bs].double().nan_to_num(0.0)
    scores = torch.einsum("rhgd,nhd->rhgn", queries.double(), keys) * queries.shape[-1] ** -0.5
    at = (first_pos + torch.arange(queries.shape[0]))[:, None]
    visible = (pos[None, :] <= at) & (window is None or (pos[None, :] > at - (window or 0)))
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    return torch.einsum("rhgn,nhd->rhgd", torch.softmax(scores, dim=-1), values)


@pytest.mark.parametrize("row_kernel", [False, True], ids=["torch", "row-kernel"])
@pytest.mark.parametrize("window", [None, 3, 9, 200, 300])
def test_a_window_reads_inside_it_alone_and_equals_dense_attention(window: int | None, row_kernel: bool) -> None:
    """Decode rows of members of different lengths (a window's group rows start at the latest
    window start, the earlier ones are each member's own) and prefill chunks with and without
    context, some longer than the window; every row below a window is NaN in the pool."""
    if row_kernel:
        require(cpu_rows.load(), "the CPU decode kernel did not build")
    g = torch.Generator().manual_seed(1 if window is None else window)
    bs, kv_heads, group, dim, num_blocks = 4, 2, 3, 8, 160
    pool = torch.randn((num_blocks, 1, 2, bs, kv_heads, dim), generator=g)
    shared = list(range(10, 10 + GROUP_MIN_ROWS // bs))  # 64 blocks: a group of 3, one sequence apart
    tables = [[*shared, 90, 91], [*shared, 92], [*shared, 93, 94, 95], [96, 97, 98]]
    lens = [len(shared) * bs + 6, len(shared) * bs + 1, len(shared) * bs + 9, 10]
    prefill = [([100, 101, 102, 103, 104], 19, 19), ([105, 106, 107, 108, 109, 110], 23, 5)]  # no context; 18 cached
    # each reader's first position: a decode row's window start, a chunk's first row's
    readers = [(t, n, 0 if window is None else max(0, n - window)) for t, n in zip(tables, lens, strict=True)]
    readers += [(t, n, 0 if window is None else max(0, n - new - window + 1)) for t, n, new in prefill]
    seen = {(t[p // bs], p % bs) for t, n, first in readers for p in range(first, n)}
    for table, _, first in readers:  # NaN where no reader's window reaches
        for p in range(first):
            if (table[p // bs], p % bs) not in seen:
                pool[table[p // bs], 0, :, p % bs] = float("nan")
    d, new = len(lens), 19 + 5
    q = torch.randn((d + new, kv_heads * group, dim), generator=g)
    k_new, v_new = torch.randn((d + new, kv_heads, dim), generator=g), torch.randn((d + new, kv_heads, dim), generator=g)
    slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens, strict=True)]
    for table, n, num_new in prefill:
        slots += [table[p // bs] * bs + p % bs for p in range(n - num_new, n)]
    rows_per_block = pool.stride(0) // pool.stride(3)
    step = StepPlan(torch.tensor(slots), tables, lens, prefill, bs, rows_per_block, torch.device("cpu"),
                    row_kernel=row_kernel, windows=(None, window))
    plan = step.reads[window]
    groups = [(m.tolist(), r.numel()) for m, r in plan.decode_groups]
    if window is not None and window <= 9:  # the group's rows in every window: too few to pay
        assert not groups
    elif window == 200:  # from the longest member's window start (265 - 200) to the shared prefix's end (256);
        assert groups == [([0, 1, 2], 256 - 65)]  # members 0 and 1 read 3 and 8 earlier rows as their own
    else:  # every member's window holds the whole shared prefix
        assert groups == [([0, 1, 2], 256)]
    out = step.attend(q, k_new, v_new, row_view(pool[:, 0, 0]), row_view(pool[:, 0, 1]), dim ** -0.5, window=window)
    assert not torch.isnan(out).any()
    queries = q.view(-1, kv_heads, group, dim)
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        want = dense_windowed(pool, table, n, queries[i : i + 1], bs, window, n - 1)
        torch.testing.assert_close(out[i].double(), want.reshape(kv_heads * group, dim), atol=1e-5, rtol=1e-5)
    start = d
    for table, n, num_new in prefill:
        want = dense_windowed(pool, table, n, queries[start : start + num_new], bs, window, n - num_new)
        torch.testing.assert_close(out[start : start + num_new].double(), want.reshape(num_new, -1, dim),
                                   atol=1e-5, rtol=1e-5)
        start += num_new
