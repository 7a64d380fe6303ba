"""TieredStore's lease methods (the daemon's shared-memory path) and inspection helpers."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore import CapacityError

from factories import SLOT, blocks_for, chain, make_store


def test_shared_pool_is_visible_to_another_mapping(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, shared_host=True)
    path, slot_bytes, num_slots = store.host_leases.shared_pool  # type: ignore[misc]
    assert (slot_bytes, num_slots) == (SLOT, 4)
    keys = chain(store, 2)
    store.put(keys, blocks_for(keys))
    fd = os.open(path, os.O_RDONLY)
    view = mmap.mmap(fd, slot_bytes * num_slots, prot=mmap.PROT_READ)
    os.close(fd)
    slots = store.host_leases.acquire(keys)
    payload = store.layout.bytes_per_block
    for key, slot in zip(keys, slots, strict=True):
        raw = bytes(view[slot * slot_bytes : slot * slot_bytes + payload])
        assert raw == blocks_for([key])[0].numpy().tobytes()
    store.host_leases.release(keys)
    store.check_integrity()
    store.close()
    assert make_store(tmp_path, host_blocks=4).host_leases.shared_pool is None


def test_read_lease_holds_blocks_against_eviction_and_delete(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=8)
    keys = chain(store, 4)
    store.put(keys, blocks_for(keys))
    slots = store.host_leases.acquire(keys[:2])
    assert len(slots) == 2
    with pytest.raises(CapacityError):
        store.delete(keys[:1])
    more = chain(store, 4, salt=1)
    store.put(more, blocks_for(more))  # evicts the two unheld blocks, not the held ones
    assert [store.view.block_info(k)["tier"] for k in keys[:2]] == ["host", "host"]  # type: ignore[index]
    store.host_leases.release(keys[:2])
    store.check_integrity()
    # a disk-only block is promoted to host by acquire_host
    store.put(chain(store, 4, salt=2), blocks_for(chain(store, 4, salt=2)))
    disk_only = [k for k in keys + more if store.view.block_info(k) and store.view.block_info(k)["tier"] == "disk"]  # type: ignore[index]
    assert disk_only
    got = store.host_leases.acquire(disk_only[:1])
    assert len(got) == 1 and store.view.block_info(disk_only[0])["tier"] == "host"  # type: ignore[index]
    store.host_leases.release(disk_only[:1])
    store.check_integrity()
    store.close()


def test_write_lease_publishes_only_on_commit(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4)
    keys = chain(store, 3)
    slots = store.host_leases.reserve(3)
    assert store.lookup(keys).num_blocks == 0  # reserved slots hold no block yet
    payload = store.layout.bytes_per_block
    rows = blocks_for(keys).view(torch.uint8).reshape(3, payload)
    for slot, row in zip(slots, rows, strict=True):
        store.level("host").tier.pool[slot, :payload].copy_(row)  # type: ignore[union-attr]
    store.host_leases.commit(keys, slots, tenant="t")
    assert store.lookup(keys).num_blocks == 3 and torch.equal(store.get(keys), blocks_for(keys))
    assert store.view.block_info(keys[0])["tenant"] == "t"  # type: ignore[index]
    again = store.host_leases.reserve(1)  # a key already held keeps its copy; the slot is freed
    store.host_leases.commit(keys[:1], again)
    assert store.stats()["host"]["num_blocks"] == 3
    with pytest.raises(CapacityError):
        store.host_leases.reserve(5)
    store.host_leases.cancel(store.host_leases.reserve(1))
    store.check_integrity()
    assert sorted(store.view.held_keys()) == sorted(keys) and store.view.held_keys("nobody") == []
    assert store.view.block_info(b"\0" * 32) is None
    store.close()


def test_a_key_twice_in_one_commit_keeps_its_first_slot(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4)
    keys = chain(store, 2)
    twice = [keys[0], keys[1], keys[0]]
    slots = store.host_leases.reserve(3)
    payload = store.layout.bytes_per_block
    for slot, row in zip(slots, blocks_for(twice).view(torch.uint8).reshape(3, payload), strict=True):
        store.level("host").tier.pool[slot, :payload].copy_(row)  # type: ignore[union-attr]
    store.host_leases.commit(twice, slots)
    assert store.stats()["host"]["num_blocks"] == 2 and torch.equal(store.get(keys), blocks_for(keys))
    store.check_integrity()  # the third slot went back to the free list
    assert len(store.host_leases.reserve(2, evict=False)) == 2


def test_reserved_slots_are_not_blocks_and_reserving_ahead_never_evicts(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, shared_host=True)
    keys = chain(store, 2)
    store.put(keys, blocks_for(keys))
    slots = store.host_leases.reserve(2, evict=False)  # the two free slots
    host = store.stats()["host"]
    assert host["num_blocks"] == 2 and host["used_bytes"] == 4 * SLOT  # reserved: taken, but no block
    with pytest.raises(CapacityError):
        store.host_leases.reserve(1, evict=False)  # none free: it would have to evict
    assert store.lookup(keys).num_blocks == 2
    store.host_leases.cancel(slots)
    store.check_integrity()
    store.close()


def _write_rows(store, keys: list[bytes], slots: list[int]) -> None:  # type: ignore[no-untyped-def]
    payload = store.layout.bytes_per_block
    rows = blocks_for(keys).view(torch.uint8).reshape(len(keys), payload)
    for slot, row in zip(slots, rows, strict=True):
        store.level("host").tier.pool[slot, :payload].copy_(row)


class _LockHolder:
    """A listener that, once armed, waits inside ``blocks_stored``: listeners run with the
    store lock held, so the put that calls it holds the lock until ``release`` is set."""

    def __init__(self) -> None:
        self.armed = False
        self.inside, self.release = threading.Event(), threading.Event()

    def blocks_stored(self, tier: str, keys: list[bytes], parents: list[bytes | None],
                      groups: list[int | None]) -> None:
        if self.armed:
            self.inside.set()
            self.release.wait(10)

    def blocks_removed(self, tier: str, keys: list[bytes], groups: list[int | None]) -> None:
        pass


@contextlib.contextmanager
def _lock_held(store) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """Another thread holds the store lock for the body: its put waits in a listener."""
    holder = _LockHolder()
    store.add_listener(holder)
    holder.armed = True
    other = chain(store, 1, salt=99)
    putter = threading.Thread(target=store.put, args=(other, blocks_for(other)))
    putter.start()
    try:
        assert holder.inside.wait(10)
        yield
    finally:
        holder.armed = False
        holder.release.set()
        putter.join(10)
        store.remove_listener(holder)


def test_non_blocking_lease_calls_never_wait_for_the_store_lock(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=8)
    keys = chain(store, 2)
    slots = store.host_leases.reserve(2)
    _write_rows(store, keys, slots)
    with _lock_held(store):
        assert store.contains(keys, blocking=False) is None
        assert store.host_leases.reserve(1, blocking=False) is None
        assert store.host_leases.commit(keys, slots, tenant="t", blocking=False) is False
    assert store.contains(keys, blocking=False) == [False, False]  # the refused commit did nothing
    assert store.host_leases.commit(keys, slots, tenant="t", blocking=False) is True
    assert torch.equal(store.get(keys), blocks_for(keys))
    store.check_integrity()
    store.close()


def test_a_non_blocking_reserve_takes_only_free_slots(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4)
    keys = chain(store, 3)
    store.put(keys, blocks_for(keys))
    assert store.host_leases.reserve(2, blocking=False) is None  # one slot free: nothing taken, nothing evicted
    assert store.lookup(keys).num_blocks == 3 and store.stats()["host"]["num_blocks"] == 3
    slot = store.host_leases.reserve(1, blocking=False)
    assert slot is not None and len(slot) == 1
    store.host_leases.cancel(slot)
    store.check_integrity()
    store.close()


def test_a_non_blocking_commit_refuses_what_must_write_below_host(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=8, write_policy="write_through")
    keys = chain(store, 2)
    slots = store.host_leases.reserve(2)
    _write_rows(store, keys, slots)
    assert store.host_leases.commit(keys, slots, blocking=False) is False  # write-through: disk I/O
    assert store.lookup(keys).num_blocks == 0
    store.host_leases.commit(keys, slots)
    assert store.lookup(keys).tiers == ("host", "host")
    assert all("disk" in store.view.block_info(k)["tiers"] for k in keys)  # type: ignore[index]
    assert torch.equal(store.get(keys), blocks_for(keys))
    store.check_integrity()
    store.close()


def test_a_host_only_acquire_holds_all_or_nothing_and_promotes_nothing(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=8)
    keys = chain(store, 6)  # the head overflows to disk: host holds 4
    store.put(keys, blocks_for(keys))
    tiers = store.lookup(keys).tiers
    assert "disk" in tiers and "host" in tiers
    hits = store.stats()["host"]["hits"]
    assert store.host_leases.acquire(keys, host_only=True) == []  # not all in host RAM: nothing held
    assert store.stats()["host"]["hits"] == hits  # nor counted
    assert store.lookup(keys).tiers == tiers  # nor promoted
    on_host = [k for k, t in zip(keys, tiers, strict=True) if t == "host"]
    hits = store.stats()["host"]["hits"]
    slots = store.host_leases.acquire(on_host, host_only=True)
    assert len(slots) == len(on_host) and store.stats()["host"]["hits"] == hits + len(on_host)
    with pytest.raises(CapacityError):
        store.delete(on_host[:1])  # held
    with _lock_held(store):
        assert store.host_leases.release(on_host, blocking=False) is False  # the lock is busy: still held
    with pytest.raises(CapacityError):
        store.delete(on_host[:1])
    assert store.host_leases.release(on_host, blocking=False) is True
    assert store.delete(on_host[:1]) == 1
    store.check_integrity()
    store.close()
