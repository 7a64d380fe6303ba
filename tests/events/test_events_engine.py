"""An engine's KV events, followed by a real ZeroMQ subscriber: after a multi-turn workload that
evicts through the device pool, host RAM and disk, the view rebuilt from the events alone
equals what the engine and its store hold; a dropped connection catches up by replay; a late
subscriber catches up by snapshot; a restarted engine is a new epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvstore.engine import LLMEngine, SamplingParams
from kvstore.events import Subscriber
from kvstore.events.wire import CPU, DISK, GPU, BlockStored

from events_helpers import free_port_pair, until
from waiting import wait_until

TINY = dict(num_layers=2, hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=128)
BLOCK_BYTES, SLOT = 2048, 4096  # one block of TINY with block_size 4 in fp32; its host/disk slot
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def make(tmp_path: Path, endpoint: str, **kwargs: Any) -> LLMEngine:
    opts: dict[str, Any] = dict(random_model=TINY, block_size=4, kv_cache_bytes=12 * BLOCK_BYTES,
                                host_bytes=10 * SLOT, disk_path=tmp_path / "disk", disk_bytes=14 * SLOT,
                                fetch_policy="always", max_num_seqs=1, kv_events=endpoint)
    opts.update(kwargs)
    return LLMEngine(None, **opts)


def converse(llm: LLMEngine, turns: int, first: int = 0) -> None:
    """Three conversations, interleaved: each turn resends the history plus new tokens."""
    history = [[(7 * c + i) % 100 + 3 for i in range(9)] for c in range(3)]
    for t in range(turns):
        outs = llm.generate(history, GREEDY)
        history = [h + o.token_ids + [(first + t * 5 + c) % 90 + 5] * 4 for c, (h, o) in
                   enumerate(zip(history, outs, strict=True))]


def device_keys(llm: LLMEngine) -> set[bytes]:
    return {k for k, _, _ in llm.block_manager.held_blocks()}


def truth(llm: LLMEngine) -> dict[str, set[bytes]]:
    """What the engine and its store hold, from their own bookkeeping, per medium.

    The store's two views must agree once no block is on its way into a tier: ``held_keys``
    also names a block being written (the engine's demotions keep coming for a moment after
    a turn), ``held_by_tier`` only what a tier holds; the two calls are retried until they
    agree (a bounded wait)."""

    def agreeing() -> dict[str, set[bytes]] | None:
        held = {GPU: device_keys(llm)}
        by_tier = llm.store.view.held_by_tier()
        held[CPU], held[DISK] = {e[0] for e in by_tier["host"]}, {e[0] for e in by_tier["disk"]}
        return held if set(llm.store.view.held_keys()) == held[CPU] | held[DISK] else None

    held = wait_until(agreeing, 5, "the store's two views agreeing", poll_s=0.01)
    assert set(llm.store.view.held_keys()) == held[CPU] | held[DISK]
    return {m: keys for m, keys in held.items() if keys}


def subscribe(llm: LLMEngine, **kwargs: Any) -> Subscriber:
    info = llm.kv_events.info()  # type: ignore[union-attr]
    return Subscriber(info["endpoint"], replay_endpoint=info["replay_endpoint"], **kwargs)


def test_device_tier_view_equals_the_engine_after_evictions(tmp_path: Path) -> None:
    llm = make(tmp_path, "tcp://127.0.0.1:*")
    stored: list[BlockStored] = []
    sub = subscribe(llm, on_batch=lambda s, b, src: stored.extend(e for e in b.events if isinstance(e, BlockStored)))
    try:
        until(lambda: sub.stats()["snapshots"] == 1, sub)
        # demotion is asynchronous, so how soon blocks reach the disk varies: converse until the
        # workload has evicted through the device, host RAM and disk (a bounded number of rounds)
        for round_ in range(6):
            converse(llm, 4, first=40 * round_)
            stats = llm.stats()
            if stats["device"]["demoted"] and stats["host"]["evictions"] and stats["disk"]["evictions"]:
                break
        assert stats["device"]["demoted"] > 0, "the workload must evict from the device"
        assert stats["host"]["evictions"] > 0 and stats["disk"]["evictions"] > 0, "and through host and disk"
        until(lambda: sub.sink.held() == truth(llm), sub)
        assert not sub.approximate and sub.stats()["unfilled_gaps"] == 0 and sub.sink.num_unknown_removals == 0
        # device events carry the blocks' tokens, block_size of them per block
        gpu = [e for e in stored if e.medium == GPU]
        assert gpu and all(len(e.token_ids) == 4 * len(e.block_hashes) for e in gpu)
        late = subscribe(llm)  # a late subscriber catches up from a snapshot
        try:
            until(lambda: late.stats()["snapshots"] == 1, late)

            def agree() -> bool:  # a demotion still in flight when the snapshot was taken arrives as events
                sub.poll(0.01)
                return late.sink.held() == truth(llm) == sub.sink.held()

            until(agree, late)
            assert late.stats()["snapshots"] == 1 and not late.approximate and late.stats()["unfilled_gaps"] == 0
        finally:
            late.close()
        sub.pause()  # the connection drops for a turn; the subscriber catches up by replay
        publisher = llm.kv_events
        assert publisher is not None
        published = publisher.stats()["events"]
        converse(llm, 1, first=20)
        wait_until(lambda: publisher.stats()["events"] > published and publisher.stats()["queued"] == 0, 10,
                   "the turn's events sent while the subscriber is away")
        sub.resume()
        until(lambda: sub.stats()["replays"] >= 1 and sub.sink.held() == truth(llm), sub)
        assert sub.stats()["snapshots"] == 1 and not sub.approximate
        llm.evict_device_cache()
        until(lambda: sub.sink.held() == truth(llm) and GPU not in truth(llm), sub)
    finally:
        sub.close()
        llm.close()


def test_engine_restart_is_a_new_epoch(tmp_path: Path) -> None:
    port = free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    llm = make(tmp_path, endpoint)
    sub = Subscriber(endpoint, replay_endpoint=f"tcp://127.0.0.1:{port + 1}", heartbeat_timeout_s=5)
    try:
        until(lambda: sub.stats()["snapshots"] == 1, sub)
        first_epoch = sub.epoch
        assert first_epoch == llm.kv_events.epoch  # type: ignore[union-attr]
        converse(llm, 2)
        until(lambda: sub.sink.held() == truth(llm) != {}, sub)
        llm.close()
        until(lambda: sub.sink.held() == {}, sub)  # the clean shutdown's AllBlocksCleared
        llm = make(tmp_path, endpoint)  # reopens the disk tier: its blocks are announced again
        assert DISK in truth(llm)
        until(lambda: sub.epoch == llm.kv_events.epoch and sub.sink.held() == truth(llm), sub)  # type: ignore[union-attr]
        converse(llm, 2, first=50)
        until(lambda: sub.sink.held() == truth(llm), sub)
        assert sub.epoch != first_epoch and sub.stats()["epochs"] == 1
        assert sub.stats()["snapshots"] >= 2 and not sub.approximate
    finally:
        sub.close()
        llm.close()


def test_engine_rejects_bad_event_endpoints(tmp_path: Path) -> None:
    from kvstore.errors import ConfigError

    with pytest.raises(ConfigError, match="kv_events"):
        LLMEngine(None, random_model=TINY, kv_events="http://nope")
    with pytest.raises(ConfigError, match="only with kv_events"):
        LLMEngine(None, random_model=TINY, kv_events_replay="tcp://127.0.0.1:1")
