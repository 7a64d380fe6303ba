"""Write-through puts write to disk outside the store lock (WritePath.put/commit, then finish).

A put's disk write is held up at the disk level; meanwhile other threads must get, put, pin
and delete other blocks without waiting; the blocks being written are in no tier yet (a put
that has not returned is not acknowledged): a lookup reports them where they land, a get,
pin or second put of them waits for the write, and close lets it finish.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore import TieredStore

from factories import (
    WRITE_WAITS,
    HeldDiskWrite,
    blocks_for,
    chain,
    crash_disk_write_once,
    finishes,
    make_store,
    started,
)
from waiting import wait_blocked


def put_via_commit(store: TieredStore, keys: list[bytes]) -> None:
    """The daemon's two-phase put: bytes into reserved host slots, then commit_host."""
    slots = store.host_leases.reserve(len(keys))
    pool = store.level("host").tier.pool  # type: ignore[union-attr]
    payload = store.layout.bytes_per_block
    rows = blocks_for(keys).view(torch.uint8).reshape(len(keys), -1)
    for slot, row in zip(slots, rows, strict=True):
        pool[slot, :payload].copy_(row)
    store.host_leases.commit(keys, slots)


@pytest.mark.parametrize("how", ["put", "commit_host"])
def test_others_do_not_wait_for_a_write_through_disk_write(tmp_path: Path, how: str) -> None:
    store = make_store(tmp_path, host_blocks=16, disk_blocks=32, write_policy="write_through")
    held = chain(store, 2, salt=1)
    store.put(held, blocks_for(held))
    gone = chain(store, 1, salt=4)
    store.put(gone, blocks_for(gone))
    hold = HeldDiskWrite(store)
    writing = chain(store, 2, salt=2)
    write = (lambda: store.put(writing, blocks_for(writing))) if how == "put" else (lambda: put_via_commit(store, writing))
    putting = started(write)
    assert hold.inside.wait(30)
    # the store lock is free: gets, puts (their own disk writes too), pins and deletes go on
    assert torch.equal(finishes(lambda: store.get(held)), blocks_for(held))
    other = chain(store, 1, salt=3)
    finishes(lambda: store.put(other, blocks_for(other)))
    assert store.view.block_info(other[0])["tiers"] == ["host", "disk"]  # type: ignore[index]
    finishes(lambda: store.pin(held))
    finishes(lambda: store.unpin(held))
    assert finishes(lambda: store.delete(gone)) == 1
    # the blocks being written are not acknowledged yet: a lookup (a hint) says where they
    # land, and whoever needs them waits for the write to settle
    assert putting.thread.is_alive()
    assert store.lookup(writing).tiers == ("host", "host")
    assert store.contains(writing) == [True, True]
    getting = started(lambda: store.get(writing))
    pinning = started(lambda: store.pin(writing))
    wait_blocked(getting.thread, *WRITE_WAITS, what="a get of blocks being written")
    wait_blocked(pinning.thread, *WRITE_WAITS, what="a pin of blocks being written")
    assert getting.thread.is_alive() and pinning.thread.is_alive(), "read or pinned blocks not on disk yet"
    hold.release(putting, getting, pinning)
    assert [store.view.block_info(k)["tiers"] for k in writing] == [["host", "disk"]] * 2  # type: ignore[index]
    assert [store.view.block_info(k)["pins"] for k in writing] == [1, 1]  # type: ignore[index]
    store.unpin(writing)
    assert torch.equal(store.get(writing), blocks_for(writing))
    store.check_integrity()
    store.close()


def test_a_put_of_keys_being_written_through_waits_for_that_write(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=16, disk_blocks=32, write_policy="write_through")
    hold = HeldDiskWrite(store)
    keys = chain(store, 2)
    first = started(lambda: store.put(keys, blocks_for(keys)))
    assert hold.inside.wait(30)
    second = started(lambda: store.put(keys, blocks_for(keys)))
    wait_blocked(second.thread, *WRITE_WAITS, what="a second put of the keys being written")
    # acknowledging it now would claim blocks on disk that are not there yet
    assert second.thread.is_alive(), "a put of keys being written through returned before they were on disk"
    hold.release(first, second)
    assert [store.view.block_info(k)["tiers"] for k in keys] == [["host", "disk"]] * 2  # type: ignore[index]
    # written once: the second put found them held and only refreshed them
    assert store.stats()["disk"]["bytes_written"] == 2 * store.level("disk").payload_bytes  # type: ignore[union-attr]
    assert hold.calls == 1
    store.check_integrity()
    store.close()


def test_check_integrity_and_close_wait_for_a_write_through_write(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=16, disk_blocks=32, write_policy="write_through")
    chains = [chain(store, 2, salt=salt) for salt in range(2)]
    for keys, wait in zip(chains, (store.check_integrity, store.close), strict=True):
        hold = HeldDiskWrite(store)
        putting = started(lambda k=keys: store.put(k, blocks_for(k)))  # type: ignore[misc]
        assert hold.inside.wait(30)
        waiting = started(wait)
        wait_blocked(waiting.thread, *WRITE_WAITS, what=wait.__name__)
        assert waiting.thread.is_alive(), f"{wait.__name__} returned while a put was between its halves"
        hold.release(putting, waiting)
    # acknowledged before close let the disk go: a new store over the same directory finds both
    reopened = make_store(tmp_path, host_blocks=16, disk_blocks=32, write_policy="write_through")
    for keys in chains:
        assert reopened.lookup(keys).tiers == ("disk", "disk")
        assert torch.equal(reopened.get(keys), blocks_for(keys))
    reopened.check_integrity()
    reopened.close()


def test_a_disk_write_that_raises_leaves_no_block_half_written_and_nobody_waiting(tmp_path: Path) -> None:
    """Not a medium failure (those return False) but a bug: the put raises it, the blocks stay
    invisible, and a later put of the same keys, check_integrity and close do not hang."""
    store = make_store(tmp_path, host_blocks=16, disk_blocks=32, write_policy="write_through")
    crash_disk_write_once(store)
    keys = chain(store, 2)
    with pytest.raises(RuntimeError, match="a bug in the disk level"):
        store.put(keys, blocks_for(keys))
    assert store.lookup(keys).num_blocks == 0
    assert store.stats()["host"]["num_blocks"] == 0
    finishes(lambda: store.put(keys, blocks_for(keys)))
    assert [store.view.block_info(k)["tiers"] for k in keys] == [["host", "disk"]] * 2  # type: ignore[index]
    finishes(store.close)
