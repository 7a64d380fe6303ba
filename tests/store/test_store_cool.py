"""Cooled blocks (``TieredStore.cool``): a sliding-window group's blocks below the window of the
boundaries their chain was used at leave every tier first, and under ``cold_blocks="drop"``
are never written down the tiers; a read or put warms them again."""

from __future__ import annotations

from pathlib import Path

import pytest

from factories import blocks_for, chain, make_store


def tiers_of(store, keys):  # type: ignore[no-untyped-def]
    return [(info or {}).get("tiers", []) for info in map(store.view.block_info, keys)]


@pytest.mark.parametrize("cold_blocks", ["demote", "drop"])
def test_cooled_blocks_are_evicted_first_and_demoted_only_if_asked(tmp_path: Path, cold_blocks: str) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=16, cold_blocks=cold_blocks)
    try:
        a, b = chain(store, 4), chain(store, 2, salt=1)
        store.put(a, blocks_for(a))
        assert store.cool([*a[:2], bytes(32)]) == 2  # an unknown key is skipped
        store.put(b, blocks_for(b))  # room for two: the cooled two leave host RAM, not a's tail
        assert tiers_of(store, a[2:]) == [["host"], ["host"]]
        below = [["disk"], ["disk"]] if cold_blocks == "demote" else [[], []]
        assert tiers_of(store, a[:2]) == below
        assert store.lookup(a).num_blocks == (4 if cold_blocks == "demote" else 0)
        store.check_integrity()
    finally:
        store.close()


def test_a_read_warms_a_cooled_block(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=16, cold_blocks="drop")
    try:
        a, b = chain(store, 4), chain(store, 1, salt=1)
        store.put(a, blocks_for(a))
        store.cool(a[:2])
        assert (store.get(a[:2]) == blocks_for(a[:2])).all()  # a hit at that boundary: warm again
        store.put(b, blocks_for(b))  # one victim: a's tail now, as for any chain; not cooled: demoted
        assert tiers_of(store, a) == [["host"], ["host"], ["host"], ["disk"]]
        store.check_integrity()
    finally:
        store.close()


def test_cooling_a_block_on_disk_only_makes_it_the_disks_next_victim(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=2, disk_blocks=3)
    try:
        a = chain(store, 3)
        store.put(a, blocks_for(a))  # host keeps two, the disk takes the overflow
        on_disk = [k for k, t in zip(a, tiers_of(store, a), strict=True) if t == ["disk"]]
        assert on_disk
        b = chain(store, 4, salt=1)
        store.cool(on_disk)
        store.put(b, blocks_for(b))  # host demotes to the disk, which makes room: the cooled first
        assert all(t == [] for t in tiers_of(store, on_disk))
        store.check_integrity()
    finally:
        store.close()
