"""Admission policies: the strategy objects alone, the access sketch, and disk admission in a
real TieredStore (real host pool, real LMDB disk tier)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.policy.admission import AdmitAll, SeenTwice, TinyLFU, make_admission
from kvstore.policy.sketch import MAX_COUNT, FrequencySketch

from factories import blocks_for, chain, make_store


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def test_all_and_seen_twice() -> None:
    keys = [key(i) for i in range(3)]
    assert AdmitAll().admit(keys, [1, 1, 1], None, True) == [True] * 3
    assert SeenTwice().admit(keys, [1, 2, 5], key(9), True) == [False, True, True]


def test_sketch_counts_saturate_and_age() -> None:
    sketch = FrequencySketch(capacity=100)  # halves every 1,000 additions
    hot, cold = key(1), key(2)
    for _ in range(20):
        sketch.add([hot])
    sketch.add([cold])
    assert sketch.estimate([hot, cold, key(3)]) == [MAX_COUNT, 1, 0]
    sketch.add([key(1000 + i) for i in range(1000)])  # 1,021 additions: one halving
    assert sketch.num_halvings == 1
    hot_now, cold_now = sketch.estimate([hot, cold])
    assert hot_now == MAX_COUNT // 2  # halved (the 1,000 others may collide with cold's counters)
    assert cold_now <= 1 < hot_now
    keyless = FrequencySketch(capacity=8)  # keys that are not digests hash too
    keyless.add(["a", "a", "b"])
    assert keyless.estimate(["a", "b", "c"]) == [2, 1, 0]


def test_tinylfu_admits_what_beats_the_victim() -> None:
    sketch = FrequencySketch(capacity=100)
    policy = TinyLFU(sketch)
    warm, hot, cold, victim = key(1), key(2), key(3), key(4)
    sketch.add([warm, warm, hot, hot, hot, cold, victim, victim])
    assert policy.admit([warm, hot, cold], [1, 1, 1], victim, True) == [False, True, False]
    assert policy.admit([cold], [1], victim, False) == [True]  # room: every block
    assert policy.admit([warm, cold], [1, 1], None, True) == [True, False]  # no victim to see: >= 2


def test_make_admission_refuses_unknown_names() -> None:
    with pytest.raises(ValueError, match=r"known: \['all', 'seen_twice', 'tinylfu'\]"):
        make_admission("lfu")
    with pytest.raises(ValueError, match="needs an access sketch"):
        make_admission("tinylfu")
    with pytest.raises(ConfigError, match="remote_admission must be one of"):
        make_store(None, host_blocks=2, remote_admission="every")


def test_tinylfu_disk_admission_in_a_store(tmp_path: Path) -> None:
    """Host holds 2 blocks, disk 4: once the disk is full, a demoted block enters only if
    read more often than the disk's next victim."""
    store = make_store(tmp_path, host_blocks=2, disk_blocks=4, disk_admission="tinylfu")
    hot = [chain(store, 1, salt=s) for s in range(4)]
    for keys in hot:
        store.put(keys, blocks_for(keys))
        for _ in range(3):
            store.get(keys)  # promoted or hit: every read counts in the sketch
    assert store.stats()["disk"]["num_blocks"] >= 2
    for s in range(10, 30):  # cold, one-off blocks: the disk fills, then refuses them
        keys = chain(store, 1, salt=s)
        store.put(keys, blocks_for(keys))
    disk_keys = {k for k, _, _ in store.view.held_by_tier()["disk"]}
    assert len(disk_keys) == 4
    assert sum(keys[0] in disk_keys for keys in hot) >= 2, "the read blocks left the disk for one-off ones"
    written = store.stats()["disk"]["bytes_written"]
    for s in range(30, 40):
        keys = chain(store, 1, salt=s)
        store.put(keys, blocks_for(keys))
    assert store.stats()["disk"]["bytes_written"] == written  # refused: nothing written
    store.check_integrity()
    store.close()


def test_seen_twice_disk_admission_writes_only_reused_blocks(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=2, disk_blocks=8, disk_admission="seen_twice")
    once = [chain(store, 1, salt=s) for s in range(6)]
    for keys in once:
        store.put(keys, blocks_for(keys))
    assert store.stats()["disk"]["num_blocks"] == 0
    twice = chain(store, 1, salt=100)
    store.put(twice, blocks_for(twice))
    store.get(twice)
    for s in range(200, 204):
        keys = chain(store, 1, salt=s)
        store.put(keys, blocks_for(keys))
    assert {k for k, _, _ in store.view.held_by_tier()["disk"]} == {twice[0]}
    store.close()
