"""A hybrid model's engine announces its device tier per KV group: a sealed device block is one
BlockStored per group whose layers hold it (the group's own keys, index, kind and window), an
evicted one a BlockRemoved per group, and a late subscriber's snapshot says the same. The view
rebuilt from the events alone reconciles the hit the engine itself would take.

The model is the seeded random one of tests/engine/test_hybrid_cache.py: two sliding-window
layers (window 8 tokens, 2 blocks of 4) to every full one, grouped as 3 KV groups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstore.engine import LLMEngine, SamplingParams
from kvstore.engine.checkpoint import AttentionSpec
from kvstore.events import Subscriber
from kvstore.events.wire import CPU, GPU, BlockRemoved, BlockStored
from kvstore.keys import BlockHasher

from events_helpers import until

SPECS = tuple(AttentionSpec("sliding_attention", 8) if i % 3 != 2 else AttentionSpec() for i in range(6))
MODEL = dict(num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, attention=SPECS)
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 60))  # 57 tokens: 14 full blocks of 4
WINDOWS = [2, 2, None]  # per group, window_blocks (None: full attention)


def make(**kwargs: Any) -> LLMEngine:
    opts: dict[str, Any] = dict(random_model=MODEL, block_size=4, kv_cache_bytes=1 << 20, host_bytes=4 << 20,
                                kv_events="tcp://127.0.0.1:*")
    opts.update(kwargs)
    return LLMEngine(None, **opts)


def subscribe(llm: LLMEngine, **kwargs: Any) -> Subscriber:
    info = llm.kv_events.info()  # type: ignore[union-attr]
    return Subscriber(info["endpoint"], replay_endpoint=info["replay_endpoint"], **kwargs)


def keys_by_group(llm: LLMEngine) -> list[list[bytes]]:
    hasher = BlockHasher(llm.namespace)
    chain = hasher.block_keys(PROMPT)
    return [hasher.group_keys(chain, g) for g in range(llm.layout.num_groups)]


def test_device_blocks_are_announced_per_group(tmp_path: Path) -> None:
    llm = make()
    events: list[Any] = []
    sub = subscribe(llm, on_batch=lambda s, b, src: events.extend(b.events))
    try:
        until(lambda: sub.stats()["snapshots"] == 1, sub)
        llm.generate([PROMPT], GREEDY)
        by_group = keys_by_group(llm)
        until(lambda: all(set(keys) <= sub.sink.blocks(GPU) for keys in by_group), sub)
        gpu = [e for e in events if isinstance(e, BlockStored) and e.medium == GPU]
        kinds = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in gpu}
        assert kinds == {(0, "sliding_window", 8), (1, "sliding_window", 8), (2, "full_attention", None)}
        for g, keys in enumerate(by_group):
            assert set(keys) <= sub.sink.blocks(GPU, group=g), f"group {g}'s keys are not its own on the wire"
            mine = [e for e in gpu if e.group_idx == g]
            assert all(len(e.token_ids) == 4 * len(e.block_hashes) for e in mine), "tokens per group block"
        # the keys of one group never name another's block
        assert len(set().union(*by_group)) == 3 * len(by_group[0])
        assert sub.sink.hit_on(GPU, by_group, WINDOWS) == 14
        late = subscribe(llm)  # a late subscriber's snapshot names the groups too
        try:
            until(lambda: late.stats()["snapshots"] == 1 and late.sink.blocks(GPU) == sub.sink.blocks(GPU), late)
            assert late.sink.hit_on(GPU, by_group, WINDOWS) == 14
            assert {late.sink.group_of(by_group[g][0]).idx for g in range(3)} == {0, 1, 2}  # type: ignore[union-attr]
        finally:
            late.close()
        llm.evict_device_cache()  # every group of every block leaves the device, into host RAM
        until(lambda: not sub.sink.blocks(GPU) and sub.sink.hit_on(CPU, by_group, WINDOWS) == 14, sub)
        removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == GPU]
        assert {e.group_idx for e in removed} == {0, 1, 2}
    finally:
        sub.close()
        llm.close()


def test_a_block_filled_from_the_store_announces_only_the_groups_it_holds(tmp_path: Path) -> None:
    """A hit moves the full group and each sliding group's window: the device blocks below the
    windows hold the full group's layers only, and say so."""
    llm = make()
    sub = subscribe(llm)
    try:
        llm.generate([PROMPT], GREEDY)
        llm.evict_device_cache()
        llm.generate([PROMPT], GREEDY)
        by_group = keys_by_group(llm)
        until(lambda: set(by_group[2]) <= sub.sink.blocks(GPU), sub)
        assert sub.sink.hit_on(GPU, by_group, WINDOWS) == 14
        for g in (0, 1):
            on_device = [k in sub.sink.blocks(GPU) for k in by_group[g]]
            assert on_device[-2:] == [True, True], f"group {g}'s window before the hit is on the device"
            assert not any(on_device[:-2]), f"group {g}'s blocks below the window were never fetched"
    finally:
        sub.close()
        llm.close()
