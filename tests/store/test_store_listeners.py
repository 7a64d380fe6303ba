"""Store listeners: the events a cascade emits rebuild exactly what each level holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from factories import blocks_for, chain, make_store


class Recorder:
    """A listener that replays the events into a per-tier block set."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = {}
        self.parents: dict[bytes, bytes | None] = {}
        self.groups: dict[bytes, int | None] = {}
        self.events: list[tuple[str, str, int]] = []

    def blocks_stored(self, tier: str, keys: list[bytes], parents: list[bytes | None],
                      groups: list[int | None]) -> None:
        tier_set = self.held.setdefault(tier, set())
        assert not tier_set & set(keys), f"{tier} told twice that it stores a block"
        tier_set.update(keys)
        self.parents.update(zip(keys, parents, strict=True))
        self.groups.update(zip(keys, groups, strict=True))
        self.events.append(("stored", tier, len(keys)))

    def blocks_removed(self, tier: str, keys: list[bytes], groups: list[int | None]) -> None:
        tier_set = self.held.setdefault(tier, set())
        assert set(keys) <= tier_set, f"{tier} told it lost a block it never stored"
        tier_set.difference_update(keys)
        self.events.append(("removed", tier, len(keys)))


def _as_sets(store) -> dict[str, set[bytes]]:  # type: ignore[no-untyped-def]
    return {tier: {k for k, _, _ in held} for tier, held in store.view.held_by_tier().items()}


def test_events_rebuild_every_level_through_eviction_promotion_and_delete(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=6)
    recorder = Recorder()
    store.add_listener(recorder)
    chains = [chain(store, 3, salt=s) for s in range(4)]
    for keys in chains:  # 12 blocks through 4 host slots and 6 disk slots: both levels evict
        store.put(keys, blocks_for(keys))
    assert store.stats()["disk"]["evictions"] > 0
    assert {t: recorder.held.get(t, set()) for t in store.levels} == _as_sets(store)
    assert ("stored", "disk", 3) in recorder.events or ("stored", "disk", 1) in recorder.events
    found = store.lookup(chains[2])
    assert "disk" in found.tiers
    store.get(chains[2][: found.num_blocks])  # promotes the disk blocks to host
    assert {t: recorder.held.get(t, set()) for t in store.levels} == _as_sets(store)
    store.delete(chains[3])
    assert {t: recorder.held.get(t, set()) for t in store.levels} == _as_sets(store)
    assert not any(k in recorder.held[t] for t in store.levels for k in chains[3])
    held = {k: p for triples in store.view.held_by_tier().values() for k, p, _ in triples}
    assert all(recorder.parents[k] == p for k, p in held.items())
    store.check_integrity()
    store.close()


def test_a_corrupt_disk_block_is_reported_removed(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=8, write_policy="write_through")
    keys = chain(store, 2)
    store.put(keys, blocks_for(keys))
    slot = store.view.block_info(keys[1])["slots"]["disk"]  # type: ignore[index]
    store.close()
    slab = tmp_path / "disk" / "slab-000.bin"
    with open(slab, "r+b") as f:
        f.seek(slot * 4096 + 7)
        byte = f.read(1)
        f.seek(slot * 4096 + 7)
        f.write(bytes([byte[0] ^ 0x01]))
    store = make_store(tmp_path, host_blocks=4, disk_blocks=8)
    recorder = Recorder()
    recorder.held["disk"] = {k for k, _, _ in store.view.held_by_tier()["disk"]}  # what a snapshot gives
    store.add_listener(recorder)
    with pytest.raises(KeyError):
        store.get(keys)
    assert keys[1] not in recorder.held["disk"] and ("removed", "disk", 1) in recorder.events
    assert recorder.held["disk"] == _as_sets(store)["disk"]
    assert torch.equal(store.get(keys[:1]), blocks_for(keys[:1]))
    store.close()


def test_a_failing_listener_is_dropped_and_the_store_carries_on(tmp_path: Path) -> None:
    class Broken:
        def blocks_stored(self, tier: str, keys: list[bytes], parents: list[bytes | None],
                      groups: list[int | None]) -> None:
            raise RuntimeError("listener bug")

        def blocks_removed(self, tier: str, keys: list[bytes], groups: list[int | None]) -> None:
            raise RuntimeError("listener bug")

    store = make_store(None, host_blocks=4)
    store.add_listener(Broken())
    keys = chain(store, 2)
    store.put(keys, blocks_for(keys))  # the listener raises; the put still lands
    assert torch.equal(store.get(keys), blocks_for(keys))
    more = chain(store, 2, salt=1)
    store.put(more, blocks_for(more))
    store.check_integrity()
    store.close()


def test_levels_name_the_cascade(tmp_path: Path) -> None:
    assert make_store(None, host_blocks=2).levels == ("host",)
    store = make_store(tmp_path, host_blocks=2, disk_blocks=2)
    assert store.levels == ("host", "disk")
    assert store.level("disk") is not None and store.level("remote") is None
    store.close()


def test_a_blocks_kv_group_reaches_the_listeners_in_every_tier_it_enters(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=2, disk_blocks=8)
    recorder = Recorder()
    store.add_listener(recorder)
    first, second = chain(store, 2), chain(store, 2, salt=1)
    store.put(first, blocks_for(first), group=1)
    store.put(second, blocks_for(second))  # demotes the first chain: its group goes with it
    assert {recorder.groups[k] for k in first} == {1} and {recorder.groups[k] for k in second} == {None}
    assert first[0] in recorder.held["disk"]
    store.close()

