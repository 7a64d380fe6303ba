"""Host RAM's demotions are written to disk once the store lock is let go (kvstore/store/demotions.py).

The disk level's write is held up while a put that made room is writing its demotions down.
Meanwhile other calls must not wait for it, unless they need the demoted blocks: those are in
no tier until the write settles (a lookup reports them on disk, where they are landing), and
a get, put or pin of them waits for it. Close waits for it too. Past the staging budget a
demotion is written under the lock, as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvstore.store.demotions as demotions
from kvstore import TieredStore

from factories import (
    WRITE_WAITS,
    HeldDiskWrite,
    Run,
    blocks_for,
    chain,
    crash_disk_write_once,
    finishes,
    make_store,
    started,
)
from waiting import wait_blocked


def full_host(tmp_path: Path) -> tuple[TieredStore, list[bytes]]:
    """A write-back store whose 4-slot host RAM holds a 4-block chain, none of it on disk."""
    store = make_store(tmp_path, host_blocks=4, disk_blocks=32)
    first = chain(store, 4, salt=1)
    store.put(first, blocks_for(first))
    return store, first


def demoting_put(store: TieredStore) -> tuple[HeldDiskWrite, list[bytes], Run]:
    """Another thread puts a 2-block chain into the full host RAM: it demotes the first chain's
    2-block tail, and its write of them to disk is held up. Returns once it is."""
    hold = HeldDiskWrite(store)
    second = chain(store, 2, salt=2)
    putting = started(lambda: store.put(second, blocks_for(second)))
    assert hold.inside.wait(30)
    return hold, second, putting


def test_other_calls_do_not_wait_for_a_demotions_disk_write(tmp_path: Path) -> None:
    store, first = full_host(tmp_path)
    hold, second, putting = demoting_put(store)
    # the store lock is free: reads of other blocks, and a put demoting blocks of its own
    assert torch.equal(finishes(lambda: store.get(first[:2])), blocks_for(first[:2]))
    assert torch.equal(finishes(lambda: store.get(second)), blocks_for(second))
    third = chain(store, 1, salt=3)
    finishes(lambda: store.put(third, blocks_for(third)))
    # the demoted tail is in no tier until its write settles; a lookup says where it lands
    assert store.lookup(first).tiers[2:] == ("disk", "disk")
    assert store.contains(first[2:]) == [True, True]
    getting = started(lambda: store.get(first))  # needs the tail: waits for it
    wait_blocked(getting.thread, *WRITE_WAITS, what="a get of the demoted tail")
    assert getting.thread.is_alive() and putting.thread.is_alive()
    hold.release(putting, getting)
    assert [store.view.block_info(k)["tiers"][-1] for k in first[2:]] == ["disk", "disk"]  # type: ignore[index]
    assert torch.equal(store.get(first), blocks_for(first))
    store.check_integrity()
    store.close()


def test_a_put_of_blocks_being_demoted_waits_for_their_write(tmp_path: Path) -> None:
    store, first = full_host(tmp_path)
    hold, _second, putting = demoting_put(store)
    again = started(lambda: store.put(first, blocks_for(first)))
    pinning = started(lambda: store.pin(first[2:]))
    wait_blocked(again.thread, *WRITE_WAITS, what="a put of blocks being demoted")
    wait_blocked(pinning.thread, *WRITE_WAITS, what="a pin of blocks being demoted")
    assert again.thread.is_alive(), "a put placed blocks whose demotion was still being written"
    assert pinning.thread.is_alive(), "a pin took blocks whose demotion was still being written"
    hold.release(putting, again, pinning)
    store.unpin(first[2:])
    assert torch.equal(store.get(first), blocks_for(first))
    store.check_integrity()
    store.close()


def test_close_waits_for_a_demotions_disk_write(tmp_path: Path) -> None:
    store, first = full_host(tmp_path)
    hold, _second, putting = demoting_put(store)
    closing = started(store.close)
    wait_blocked(closing.thread, *WRITE_WAITS, what="close")
    assert closing.thread.is_alive(), "close returned while a demotion was being written"
    hold.release(putting, closing)
    reopened = make_store(tmp_path, host_blocks=4, disk_blocks=32)
    assert reopened.lookup(first).tiers == ("disk",) * 4  # the demoted tail, and the head written back
    assert torch.equal(reopened.get(first), blocks_for(first))
    reopened.check_integrity()
    reopened.close()


def test_past_the_staging_budget_a_demotion_is_written_under_the_lock(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demotions, "MIN_BYTES", 0)
    monkeypatch.setattr(demotions, "MAX_BYTES", 0)
    store, first = full_host(tmp_path)
    hold, _second, putting = demoting_put(store)
    getting = started(lambda: store.get(first[:2]))
    wait_blocked(getting.thread, "read_into", what="a get of host blocks")  # its first step takes the lock
    assert getting.thread.is_alive()  # no staging room: the put writes its demotions holding the lock
    hold.release(putting, getting)
    assert store.lookup(first).tiers == ("host", "host", "disk", "disk")
    store.check_integrity()
    store.close()


def test_a_demotion_whose_write_raises_is_lost_and_nothing_waits(tmp_path: Path) -> None:
    """Not a medium failure (those return False) but a bug: logged, those demotions are lost."""
    store, first = full_host(tmp_path)
    crash_disk_write_once(store)
    second = chain(store, 2, salt=2)
    finishes(lambda: store.put(second, blocks_for(second)))
    assert store.lookup(first).tiers == ("host", "host")  # the tail is lost, nothing half-written
    finishes(lambda: store.put(first, blocks_for(first)))
    assert torch.equal(store.get(first), blocks_for(first))
    store.check_integrity()
    finishes(store.close)


def test_a_non_blocking_commit_of_blocks_being_demoted_refuses_rather_than_waits(tmp_path: Path) -> None:
    """The daemon's event loop commits with ``blocking=False``: it must never wait for a disk
    write, so a commit of blocks being demoted is left to a worker (False, nothing done)."""
    store = make_store(tmp_path, host_blocks=6, disk_blocks=32, shared_host=True)
    first = chain(store, 4, salt=1)
    store.put(first, blocks_for(first))
    slots = store.host_leases.reserve(2)  # host RAM is full now: 4 blocks and 2 reserved slots
    pool = store.level("host").tier.pool  # type: ignore[union-attr]
    rows = blocks_for(first[2:]).view(torch.uint8).reshape(2, -1)
    for slot, row in zip(slots, rows, strict=True):
        pool[slot, : row.numel()].copy_(row)
    hold, _second, putting = demoting_put(store)  # demotes first[2:]
    assert finishes(lambda: store.host_leases.commit(first[2:], slots, blocking=False)) is False
    committing = started(lambda: store.host_leases.commit(first[2:], slots))
    wait_blocked(committing.thread, *WRITE_WAITS, what="a blocking commit of blocks being demoted")
    assert committing.thread.is_alive()  # a worker's commit waits for the demotion to settle
    hold.release(putting, committing)
    assert torch.equal(store.get(first), blocks_for(first))
    store.check_integrity()
    store.close()
