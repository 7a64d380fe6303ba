"""A host copy decoded from the int8 disk, replaced by the bytes put (put or host_leases.commit) while
it is being read: its readers keep their slot and its bytes; nobody else gets that slot until
the last reader is done."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvstore import TieredStore

from factories import blocks_for, chain, make_store

HOST_BLOCKS = 4


def _decoded_on_host(tmp_path: Path) -> tuple[TieredStore, list[bytes]]:
    """A store whose host holds a 2-block chain as copies decoded from the int8 disk, the
    tail in host slot 0 and the head in slot 1: a re-put handing out the lowest free slots
    first would give the tail's old slot to the head."""
    store = make_store(tmp_path, host_blocks=HOST_BLOCKS, disk_blocks=16, disk_codec="int8",
                       write_policy="write_through")
    keys = chain(store, 2)
    store.put(keys, blocks_for(keys))
    store.close()
    store = make_store(tmp_path, host_blocks=HOST_BLOCKS, disk_blocks=16, disk_codec="int8")
    store.get(keys[1:])  # promoted: host holds the decoded copies now
    store.get(keys[:1])
    assert store.lookup(keys).lossy == (True, True)
    assert [_host_slot(store, k) for k in keys] == [1, 0]
    return store, keys


def _host_slot(store: TieredStore, key: bytes) -> int | None:
    info = store.view.block_info(key)
    return None if info is None else info["slots"].get("host")  # type: ignore[no-any-return]


def _slot_bytes(store: TieredStore, slot: int) -> bytes:
    payload = store.layout.bytes_per_block
    return bytes(store.level("host").tier.pool[slot, :payload].numpy())  # type: ignore[union-attr]


def _replace(store: TieredStore, keys: list[bytes], how: str) -> None:
    """Store the bytes put under ``keys`` again, by put or by a commit of reserved slots."""
    if how == "put":
        store.put(keys, blocks_for(keys))
        return
    slots = store.host_leases.reserve(len(keys))
    payload = store.layout.bytes_per_block
    for slot, row in zip(slots, blocks_for(keys).view(torch.uint8).reshape(len(keys), payload), strict=True):
        store.level("host").tier.pool[slot, :payload].copy_(row)  # type: ignore[union-attr]
    store.host_leases.commit(keys, slots)


@pytest.mark.parametrize("how", ["put", "commit"])
def test_a_leased_slot_keeps_its_bytes_when_its_decoded_copy_is_replaced(tmp_path: Path, how: str) -> None:
    store, keys = _decoded_on_host(tmp_path)
    decoded = store.get(keys[1:])
    leased = store.host_leases.acquire(keys[1:])[0]
    before = _slot_bytes(store, leased)
    assert before == decoded.numpy().tobytes()

    _replace(store, keys, how)
    assert store.lookup(keys, exact=True).tiers == ("host", "host")  # the bytes put, in other slots
    assert leased not in {_host_slot(store, k) for k in keys}
    assert _slot_bytes(store, leased) == before
    assert torch.equal(store.get(keys, exact=True), blocks_for(keys))
    # more blocks than host holds: every slot that can be reused is
    others = chain(store, HOST_BLOCKS, salt=1)
    store.put(others, blocks_for(others))
    assert leased not in {_host_slot(store, k) for k in keys + others}
    assert _slot_bytes(store, leased) == before  # the lease still reads the copy it was given
    store.check_integrity()  # the kept slot counts as used

    host = store.level("host")
    num_free = host.num_free  # type: ignore[union-attr]
    store.host_leases.release(keys[1:])  # the last reader is done: the kept slot is free again
    assert host.num_free == num_free + 1  # type: ignore[union-attr]
    store.check_integrity()
    free = store.host_leases.reserve(num_free + 1, evict=False)
    assert leased in free
    store.host_leases.cancel(free)
    store.close()


def test_a_get_copying_outside_the_lock_gets_the_copy_it_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A get too large to copy under the store lock marks its blocks as being read, then copies;
    # here it is paused inside that copy while a put replaces the decoded copy it is reading.
    monkeypatch.setattr("kvstore.store.reads.LOCKED_COPY_BYTES", 0)
    store, keys = _decoded_on_host(tmp_path)
    decoded = store.get(keys[1:])
    tier = store.level("host").tier  # type: ignore[union-attr]
    real_read = tier.read
    inside, go = threading.Event(), threading.Event()

    def paused_read(slots, dst, non_blocking=False):  # type: ignore[no-untyped-def]
        inside.set()
        assert go.wait(timeout=30)
        return real_read(slots, dst, non_blocking)

    monkeypatch.setattr(tier, "read", paused_read)
    got: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: got.append(store.get(keys[1:])))
    reader.start()
    assert inside.wait(timeout=30)
    monkeypatch.setattr(tier, "read", real_read)
    store.put(keys, blocks_for(keys))  # both decoded copies are replaced by the bytes put
    store.check_integrity()
    go.set()
    reader.join(timeout=30)
    assert got and torch.equal(got[0], decoded)  # the copy it found, not another block's bytes
    assert torch.equal(store.get(keys, exact=True), blocks_for(keys))
    store.check_integrity()
    store.close()
