"""TieredStore's lease methods (the daemon's shared-memory path) and inspection helpers."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

from kvstore import CapacityError

from factories import SLOT, blocks_for, chain, make_store


def test_shared_pool_is_visible_to_another_mapping(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, shared_host=True)
    path, slot_bytes, num_slots = store.shared_pool  # type: ignore[misc]
    assert (slot_bytes, num_slots) == (SLOT, 4)
    keys = chain(store, 2)
    store.put(keys, blocks_for(keys))
    fd = os.open(path, os.O_RDONLY)
    view = mmap.mmap(fd, slot_bytes * num_slots, prot=mmap.PROT_READ)
    os.close(fd)
    slots = store.acquire_host(keys)
    payload = store.layout.bytes_per_block
    for key, slot in zip(keys, slots, strict=True):
        raw = bytes(view[slot * slot_bytes : slot * slot_bytes + payload])
        assert raw == blocks_for([key])[0].numpy().tobytes()
    store.release_host(keys)
    store.check_integrity()
    store.close()
    assert make_store(tmp_path, host_blocks=4).shared_pool is None


def test_read_lease_holds_blocks_against_eviction_and_delete(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=8)
    keys = chain(store, 4)
    store.put(keys, blocks_for(keys))
    slots = store.acquire_host(keys[:2])
    assert len(slots) == 2
    with pytest.raises(CapacityError):
        store.delete(keys[:1])
    more = chain(store, 4, salt=1)
    store.put(more, blocks_for(more))  # evicts the two unheld blocks, not the held ones
    assert [store.block_info(k)["tier"] for k in keys[:2]] == ["host", "host"]  # type: ignore[index]
    store.release_host(keys[:2])
    store.check_integrity()
    # a disk-only block is promoted to host by acquire_host
    store.put(chain(store, 4, salt=2), blocks_for(chain(store, 4, salt=2)))
    disk_only = [k for k in keys + more if store.block_info(k) and store.block_info(k)["tier"] == "disk"]  # type: ignore[index]
    assert disk_only
    got = store.acquire_host(disk_only[:1])
    assert len(got) == 1 and store.block_info(disk_only[0])["tier"] == "host"  # type: ignore[index]
    store.release_host(disk_only[:1])
    store.check_integrity()
    store.close()


def test_write_lease_publishes_only_on_commit(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4)
    keys = chain(store, 3)
    slots = store.reserve_host(3)
    assert store.lookup(keys).num_blocks == 0  # reserved slots hold no block yet
    payload = store.layout.bytes_per_block
    rows = blocks_for(keys).view(torch.uint8).reshape(3, payload)
    for slot, row in zip(slots, rows, strict=True):
        store.level("host").tier.pool[slot, :payload].copy_(row)  # type: ignore[union-attr]
    store.commit_host(keys, slots, tenant="t")
    assert store.lookup(keys).num_blocks == 3 and torch.equal(store.get(keys), blocks_for(keys))
    assert store.block_info(keys[0])["tenant"] == "t"  # type: ignore[index]
    again = store.reserve_host(1)  # a key already held keeps its copy; the slot is freed
    store.commit_host(keys[:1], again)
    assert store.stats()["host"]["num_blocks"] == 3
    with pytest.raises(CapacityError):
        store.reserve_host(5)
    store.cancel_host(store.reserve_host(1))
    store.check_integrity()
    assert sorted(store.held_keys()) == sorted(keys) and store.held_keys("nobody") == []
    assert store.block_info(b"\0" * 32) is None
    store.close()


def test_reserved_slots_are_not_blocks_and_reserving_ahead_never_evicts(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, shared_host=True)
    keys = chain(store, 2)
    store.put(keys, blocks_for(keys))
    slots = store.reserve_host(2, evict=False)  # the two free slots
    host = store.stats()["host"]
    assert host["num_blocks"] == 2 and host["used_bytes"] == 4 * SLOT  # reserved: taken, but no block
    with pytest.raises(CapacityError):
        store.reserve_host(1, evict=False)  # none free: it would have to evict
    assert store.lookup(keys).num_blocks == 2
    store.cancel_host(slots)
    store.check_integrity()
    store.close()
