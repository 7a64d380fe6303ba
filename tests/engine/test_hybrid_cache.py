"""A hybrid model's prefix cache (kvstore/engine/groups.py, group_hits.py): per-group blocks in
every tier, a hit reconciled across groups, only the window of a sliding group moved, and the
output always what a run with no cache at all gives.

The model is the seeded random one with two sliding-window layers (window 8 tokens: 2 blocks
of 4 before a boundary) to every full one; prompts of 57 tokens (14 full blocks) are far
longer than the window, so a hit that brought the wrong window back would change the text.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon.daemon_helpers import DaemonProc

from kvstore.engine import LLMEngine, SamplingParams
from kvstore.engine.checkpoint import AttentionSpec

SPECS = tuple(AttentionSpec("sliding_attention", 8) if i % 3 != 2 else AttentionSpec() for i in range(6))
MODEL = dict(num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, attention=SPECS)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 60))  # 57 tokens: 14 full blocks of 4
GROUP_BLOCK = 2 * 2 * 4 * 2 * 16 * 4  # 2 layer slots, K and V, 4 tokens, 2 heads, dim 16, float32


def engine(**kwargs: Any) -> LLMEngine:
    return LLMEngine(None, random_model=MODEL, block_size=4, kv_cache_bytes=1 << 20, **kwargs)


@pytest.fixture(scope="module")
def expected() -> list[int]:
    """The text with no cache anywhere: nothing stored, nothing looked up."""
    with engine(host_bytes=0, enable_prefix_caching=False) as llm:
        return llm.generate([PROMPT], GREEDY)[0].token_ids


def run_twice(llm: LLMEngine) -> Any:
    """Generate, push every block off the device into the store, and generate again."""
    first = llm.generate([PROMPT], GREEDY)[0]
    llm.block_manager.evict_all()
    llm.block_manager.demoter.drain()  # type: ignore[union-attr]
    return first, llm.generate([PROMPT], GREEDY)[0]


def test_the_layout_has_two_sliding_groups_and_one_full(expected: list[int]) -> None:
    with engine(host_bytes=4 << 20) as llm:
        assert llm.layout.fingerprint().endswith("-Gs8:0,3/s8:1,4/f:2,5")
        assert llm.layout.block_shape == (2, 2, 4, 2, 16) and llm.pool_layout.block_shape == (6, 2, 4, 2, 16)


def test_a_hit_from_host_ram_moves_the_full_group_and_only_the_windows(expected: list[int]) -> None:
    with engine(host_bytes=4 << 20) as llm:
        first, again = run_twice(llm)
        assert first.token_ids == again.token_ids == expected
        assert again.metrics.cached_tokens["host"] == 56  # all 14 blocks: the hit is whole
        read = llm.store.stats()["host"]["bytes_read"]  # type: ignore[union-attr]
        assert read == (14 + 2 * 2) * GROUP_BLOCK  # the full group's 14 blocks, each window's 2
        llm.check_integrity()


def test_with_hybrid_kv_off_a_hit_moves_every_layer_of_every_block(expected: list[int]) -> None:
    """The baseline `kvstore bench hybrid` measures against: one block of all six layers."""
    with engine(host_bytes=4 << 20, hybrid_kv=False) as llm:
        assert llm.layout == llm.pool_layout and not llm.layout.groups
        first, again = run_twice(llm)
        assert first.token_ids == again.token_ids == expected
        assert again.metrics.cached_tokens["host"] == 56
        assert llm.store.stats()["host"]["bytes_read"] == 14 * 3 * GROUP_BLOCK  # type: ignore[union-attr]


@pytest.mark.parametrize("tier", ["disk", "daemon"])
def test_a_hit_from_a_lower_tier_is_reconciled_too(tier: str, tmp_path: Path, expected: list[int]) -> None:
    if tier == "disk":
        kwargs: dict[str, Any] = dict(host_bytes=64 << 10, disk_path=tmp_path / "disk", disk_bytes=4 << 20)
        daemon = None
    else:
        daemon = DaemonProc(tmp_path / "data", host_mem="8MiB", disk="0")
        kwargs = dict(store_url=daemon.unix)
    try:
        with engine(**kwargs) as llm:
            first, again = run_twice(llm)
            assert first.token_ids == again.token_ids == expected
            assert sum(n for t, n in again.metrics.cached_tokens.items() if t != "device") == 56
    finally:
        if daemon is not None:
            daemon.stop()


def test_a_missing_window_block_shrinks_the_hit_and_nothing_wrong_is_decoded(expected: list[int]) -> None:
    with engine(host_bytes=4 << 20) as llm:
        llm.generate([PROMPT], GREEDY)
        llm.block_manager.evict_all()
        llm.block_manager.demoter.drain()  # type: ignore[union-attr]
        keys = llm.store.block_keys(PROMPT)  # type: ignore[union-attr]
        llm.store.delete(llm.store.group_keys(keys[13:14], 0))  # type: ignore[union-attr]  # a window block at 14
        again = llm.generate([PROMPT], GREEDY)[0]
        assert again.token_ids == expected
        # at 14 the first sliding window lacks block 13; at 13 both windows (blocks 11, 12) hold
        assert again.metrics.cached_tokens["host"] == 13 * 4
        llm.check_integrity()


def test_a_sliding_group_with_nothing_stored_means_no_hit(expected: list[int]) -> None:
    with engine(host_bytes=4 << 20) as llm:
        llm.generate([PROMPT], GREEDY)
        llm.block_manager.evict_all()
        llm.block_manager.demoter.drain()  # type: ignore[union-attr]
        keys = llm.store.block_keys(PROMPT)  # type: ignore[union-attr]
        llm.store.delete(llm.store.group_keys(keys, 1))  # type: ignore[union-attr]
        again = llm.generate([PROMPT], GREEDY)[0]
        assert again.token_ids == expected and again.metrics.cached_tokens["host"] == 0


def test_a_device_block_filled_from_the_store_serves_a_longer_prompt(expected: list[int]) -> None:
    """After a hit the device holds blocks with only some groups' layers (below the windows,
    only the full group's). A longer prompt over the same prefix hits them on the device and
    fetches the groups its own windows need: the text is still the uncached one's."""
    longer = [*PROMPT, 61, 62, 63, 64, 65, 66, 67]  # 64 tokens: 16 full blocks
    with engine(host_bytes=0, enable_prefix_caching=False) as reference:
        want = reference.generate([longer], GREEDY)[0].token_ids
    with engine(host_bytes=4 << 20) as llm:
        run_twice(llm)  # the device now holds partial blocks from the second run's hit
        assert any(b.valid not in (0, 0b111) for b in llm.block_manager.blocks)
        out = llm.generate([longer], GREEDY)[0]
        assert out.token_ids == want
        llm.check_integrity()


def test_prompts_arriving_together_share_the_blocks_their_first_computes() -> None:
    """Three prompts over the same 56 tokens, queued before the first step: the first computes
    the prefix, the others take its blocks (every group's layers) in the same step, and each
    text is the uncached one's."""
    prompts = [[*PROMPT[:56], 70 + i, 80 + i] for i in range(3)]
    with engine(host_bytes=0, enable_prefix_caching=False) as reference:
        want = [o.token_ids for o in reference.generate(prompts, GREEDY)]
    with engine(host_bytes=0) as llm:
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == want
        assert [o.metrics.cached_tokens["device"] for o in outs] == [0, 56, 56]
        assert sum(o.metrics.num_computed_tokens for o in outs) == 56 + 3 * 2
        llm.check_integrity()


def test_the_blocks_below_the_window_of_a_finished_request_are_cooled(tmp_path: Path) -> None:
    """With cold_blocks="drop" a sliding group's blocks below the last window never reach the
    disk: host RAM (64 slots: the first request's 48 group blocks fit until it ends) drops
    them when later requests make it room, and demotes the rest."""
    with engine(host_bytes=256 << 10, disk_path=tmp_path / "disk", disk_bytes=8 << 20, cold_blocks="drop") as llm:
        llm.generate([PROMPT], GREEDY)
        llm.block_manager.evict_all()
        llm.block_manager.demoter.drain()  # type: ignore[union-attr]
        for salt in range(4):  # other prompts push the first out of host RAM
            llm.generate([[(salt * 97 + i) % 500 + 1 for i in range(57)]], GREEDY)
            llm.block_manager.evict_all()
        llm.block_manager.demoter.drain()  # type: ignore[union-attr]
        store = llm.store
        keys = store.block_keys(PROMPT)  # type: ignore[union-attr]
        # the prompt ends at block 14 (the output's blocks do not count: a follow-up resends
        # the prompt, its copy of the output may tokenize otherwise): the window there is 12, 13
        sliding_low = store.group_keys(keys[:12], 0)  # type: ignore[union-attr]
        window = store.group_keys(keys[12:14], 0)  # type: ignore[union-attr]
        full = store.group_keys(keys, 2)  # type: ignore[union-attr]
        assert store.contains(full) == [True] * len(full)  # type: ignore[union-attr]
        assert not any(store.contains(sliding_low))  # type: ignore[union-attr]
        assert store.contains(window) == [True, True]  # type: ignore[union-attr]
        llm.check_integrity()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from kvstore.tools.bench.redis_local import MIB, RedisCluster
    from tests.remote.conftest import require_redis

    require_redis()
    cluster = RedisCluster.start(tmp_path_factory.mktemp("cluster"), maxmemory=32 * MIB)
    yield cluster
    cluster.close()


def test_a_hit_from_the_remote_tier_is_reconciled_too(redis_cluster: Any, expected: list[int]) -> None:
    with engine(host_bytes=4 << 20, remote_url=redis_cluster.url) as writer:
        writer.generate([PROMPT], GREEDY)
        writer.block_manager.evict_all()
        writer.block_manager.demoter.drain()  # type: ignore[union-attr]
        assert writer.store.flush(10)  # type: ignore[union-attr]
    with engine(host_bytes=4 << 20, remote_url=redis_cluster.url) as reader:  # another node: only the remote
        out = reader.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == expected and out.metrics.cached_tokens.get("remote", 0) == 56
