"""Bad inputs get a ValueError naming the numbers, from the Triton launchers and the references."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvstore.kernels import block_copy, cache_write, decode_attention, prefill_attention, reference

from kernel_testing import DEVICE, cu_seqlens, make_paged_kv, random_queries

ON_CPU = pytest.mark.skipif(DEVICE.type != "cpu", reason="range checks run on CPU tensors only")

DECODE = {"triton": decode_attention.paged_decode_attention, "reference": reference.paged_decode_attention}
PREFILL = {"triton": prefill_attention.paged_prefill_attention, "reference": reference.paged_prefill_attention}
STORE = {"triton": cache_write.store_kv, "reference": reference.store_kv}
GATHER = {"triton": block_copy.gather_blocks, "reference": reference.gather_blocks}
SCATTER = {"triton": block_copy.scatter_blocks, "reference": reference.scatter_blocks}
IMPLS = ["triton", "reference"]


def _decode_args(**overrides: object) -> dict[str, object]:
    kv = make_paged_kv([5, 20], 2, 32, 16, torch.float32)
    args: dict[str, object] = {
        "q": random_queries(2, 4, 32, torch.float32), "k_cache": kv.k_cache, "v_cache": kv.v_cache,
        "block_tables": kv.block_tables, "seq_lens": kv.seq_lens, "scale": 0.1,
    }  # fmt: skip
    args.update(overrides)
    return args


def _call(fn: Callable[..., object], args: dict[str, object]) -> None:
    fn(*args.values())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {"q": a["q"].half()}, "must equal the cache dtype"),
        (lambda a: {"q": a["q"][0]}, "must have 3 dims"),
        (lambda a: {"q": random_queries(2, 3, 32, torch.float32)}, "3 heads, not a multiple of 2"),
        (lambda a: {"q": random_queries(2, 4, 16, torch.float32)}, "head_dim 16 must equal the cache head_dim 32"),
        (lambda a: {"block_tables": a["block_tables"].long()}, "block_tables dtype"),
        (lambda a: {"seq_lens": a["seq_lens"][:1]}, "expected 2 sequences"),
        (lambda a: {"v_cache": a["v_cache"][:, :8]}, "must match"),
        (lambda a: {"k_cache": a["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)}, "contiguous in head_dim"),
    ],
)
def test_decode_rejects_bad_shapes_and_dtypes(impl: str, change: Callable, message: str) -> None:
    args = _decode_args()
    args.update(change(args))
    with pytest.raises(ValueError, match=message):
        _call(DECODE[impl], args)


@ON_CPU
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_rejects_out_of_range_tables(impl: str) -> None:
    args = _decode_args()
    tables = args["block_tables"]
    assert isinstance(tables, torch.Tensor)
    tables = tables.clone()
    tables[1, 1] = 10_000
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = 10000 is outside \[0, \d+\)"):
        _call(DECODE[impl], {**args, "block_tables": tables})
    too_long = torch.tensor([5, 10_000], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[0, \d+\].*max 10000"):
        _call(DECODE[impl], {**args, "seq_lens": too_long})


def test_triton_rejects_geometry_it_cannot_tile() -> None:
    kv = make_paged_kv([5, 20], 2, 32, 8, torch.float32)
    with pytest.raises(ValueError, match="power-of-two block_size >= 16, got 8"):
        _call(DECODE["triton"], _decode_args(k_cache=kv.k_cache, v_cache=kv.v_cache, block_tables=kv.block_tables))
    kv = make_paged_kv([5, 20], 1, 40, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of 16, got 40"):
        _call(DECODE["triton"], _decode_args(q=random_queries(2, 2, 40, torch.float32), k_cache=kv.k_cache, v_cache=kv.v_cache))
    with pytest.raises(ValueError, match="partition_size must be a positive multiple of 64, got 48"):
        decode_attention.paged_decode_attention(*_decode_args().values(), partition_size=48)  # type: ignore[arg-type]


@ON_CPU
def test_triton_decode_rejects_a_max_seq_len_below_a_length() -> None:
    with pytest.raises(ValueError, match="max_seq_len 16 is below the longest sequence, 20 tokens"):
        decode_attention.paged_decode_attention(*_decode_args().values(), max_seq_len=16)  # type: ignore[arg-type]


@ON_CPU
@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_rejects_bad_cu_seqlens(impl: str) -> None:
    kv = make_paged_kv([5, 20], 1, 32, 16, torch.float32)
    q = random_queries(7, 2, 32, torch.float32)
    base = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    with pytest.raises(ValueError, match="rise from 0 to 7"):
        PREFILL[impl](*base, cu_seqlens([2, 4]), 0.1)
    with pytest.raises(ValueError, match="sequence 0 has 6 new tokens but seq_len 5"):
        PREFILL[impl](*base, cu_seqlens([6, 1]), 0.1)
    with pytest.raises(ValueError, match="expected num_seqs \\+ 1 = 3"):
        PREFILL[impl](*base, cu_seqlens([7]), 0.1)


@pytest.mark.parametrize("impl", IMPLS)
def test_store_kv_rejects_bad_inputs(impl: str) -> None:
    kv = make_paged_kv([5], 2, 32, 16, torch.float16)
    key = random_queries(3, 2, 32, torch.float16)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping dtype"):
        STORE[impl](key, key, kv.k_cache, kv.v_cache, slots.int())
    with pytest.raises(ValueError, match=r"key shape \(3, 4, 32\) must be \[3, 2, 32\]"):
        wide = random_queries(3, 4, 32, torch.float16)
        STORE[impl](wide, wide, kv.k_cache, kv.v_cache, slots)
    with pytest.raises(ValueError, match="key dtype"):
        STORE[impl](key.float(), key.float(), kv.k_cache, kv.v_cache, slots)
    if DEVICE.type == "cpu":
        num_slots = kv.k_cache.shape[0] * 16
        with pytest.raises(ValueError, match=rf"slot_mapping\[1\] = {num_slots} is outside \[-1, {num_slots}\)"):
            STORE[impl](key, key, kv.k_cache, kv.v_cache, torch.tensor([0, num_slots, 2]))


@pytest.mark.parametrize("impl", IMPLS)
def test_block_copies_reject_bad_inputs(impl: str) -> None:
    pool = torch.zeros((6, 2, 4), device=DEVICE)
    with pytest.raises(ValueError, match=r"staging shape \(2, 2, 5\) must be \(2, 2, 4\)"):
        GATHER[impl](pool, torch.tensor([0, 1]), torch.zeros((2, 2, 5), device=DEVICE))
    with pytest.raises(ValueError, match="block_ids dtype"):
        GATHER[impl](pool, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="blocks must be contiguous payloads"):
        GATHER[impl](pool.transpose(1, 2), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"block_ids must lie in \[0, 6\), got min 0 max 6"):
        GATHER[impl](pool, torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="must be distinct for a scatter"):
        SCATTER[impl](pool, torch.tensor([1, 1]), torch.zeros((2, 2, 4), device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA")
def test_triton_block_copy_rejects_pageable_host_staging() -> None:
    pool = torch.zeros((6, 2, 4), device=DEVICE)
    with pytest.raises(ValueError, match="pinned host memory"):
        block_copy.gather_blocks(pool, torch.tensor([0]), torch.zeros((1, 2, 4)))
