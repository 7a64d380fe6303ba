"""TieredStore under faults: kill -9 mid-put, flipped bytes in the slab, a failing disk, a
full filesystem under write-through, a catalog that cannot commit a delete."""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kvstore.tiers.catalog as catalog_module
from kvstore import CapacityError
from kvstore.store.index import BlockEntry
from kvstore.tiers.errors import TierFullError

from factories import WRITE_WAITS, blocks_for, chain, make_store, started
from waiting import wait_blocked

# Large enough that no acknowledged block is ever evicted: the storm puts at most
# STORM_PUTS chains (<= 3 blocks each) per child, 20 children.
STORM_DISK_BLOCKS = 1 << 15
STORM_PUTS = 500


def _put_storm(disk_dir: str, first_salt: int, conn) -> None:  # type: ignore[no-untyped-def]
    """Child: put chains under write-through, reporting each acknowledged salt, until killed."""
    store = make_store(Path(disk_dir), host_blocks=4, disk_blocks=STORM_DISK_BLOCKS, write_policy="write_through")
    conn.send("ready")
    for salt in range(first_salt, first_salt + STORM_PUTS):
        keys = chain(store, 1 + salt % 3, salt=salt)
        store.put(keys, blocks_for(keys))
        conn.send(salt)  # acknowledged: durable before this message leaves
    time.sleep(3600)  # held here until the parent's kill -9 (the kill is what is tested)


@pytest.mark.slow
def test_kill_9_during_put_storm_never_yields_corrupt_blocks(tmp_path: Path) -> None:
    # A forkserver imports torch once; every child is a cheap fork of that clean process.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "kvstore", "factories"])
    rng = random.Random(7)
    acknowledged: list[int] = []
    next_salt = 0
    for _ in range(20):
        parent_end, child_end = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_put_storm, args=(str(tmp_path), next_salt, child_end))
        child.start()
        child_end.close()
        assert parent_end.recv() == "ready"
        time.sleep(rng.uniform(0.0, 0.25))  # a random moment of the storm to kill it at: the test's point
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join()
        acked = []
        while parent_end.poll():
            try:
                acked.append(parent_end.recv())
            except EOFError:
                break
        acknowledged += acked
        next_salt = (max(acked) + 1 if acked else next_salt) + 1  # skip the salt that was in flight
        store = make_store(tmp_path, host_blocks=4, disk_blocks=STORM_DISK_BLOCKS, write_policy="write_through")
        try:
            store.check_integrity()
            for salt in acknowledged:
                keys = chain(store, 1 + salt % 3, salt=salt)
                assert store.lookup(keys).num_blocks == len(keys), f"acknowledged chain {salt} lost"
                assert torch.equal(store.get(keys), blocks_for(keys))
        finally:
            store.close()
    assert len(acknowledged) > 20, "the children barely ran; the test proved little"


def _slab_file(disk_dir: Path) -> Path:
    files = [p for p in disk_dir.rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def test_flipped_bytes_are_misses_and_counted(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=32, write_policy="write_through")
    chains = [chain(store, 2, salt=s) for s in range(6)]
    for keys in chains:
        store.put(keys, blocks_for(keys))
    slots = {k: store.view.block_info(k)["slots"]["disk"] for keys in chains for k in keys}  # type: ignore[index]
    store.close()
    victim = chains[2][1]  # the tail of chain 2
    slab = _slab_file(tmp_path / "disk")
    with open(slab, "r+b") as f:
        f.seek(slots[victim] * 4096 + 100)
        byte = f.read(1)
        f.seek(slots[victim] * 4096 + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    store = make_store(tmp_path, host_blocks=4, disk_blocks=32)
    with pytest.raises(KeyError, match=victim.hex()):
        store.get(chains[2])
    assert store.stats()["disk"]["errors"] >= 1
    assert store.lookup(chains[2]).num_blocks == 1  # the corrupt block is gone, its head is not
    for keys in chains[:2] + chains[3:]:
        assert torch.equal(store.get(keys), blocks_for(keys))
    store.check_integrity()
    store.close()


def test_disk_errors_are_counted_and_host_keeps_working(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(tmp_path, host_blocks=2, disk_blocks=16)
    import kvstore.tiers.slab as slab_module

    failing = {"on": True}
    real_pwritev = os.pwritev

    def broken_pwritev(fd, buffers, offset, *args):  # type: ignore[no-untyped-def]
        if failing["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset, *args)

    monkeypatch.setattr(slab_module.os, "pwritev", broken_pwritev)
    real_pwrite = os.pwrite

    def broken_pwrite(fd, data, offset):  # type: ignore[no-untyped-def]
        if failing["on"]:
            raise OSError(errno.EIO, "Input/output error")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(slab_module.os, "pwrite", broken_pwrite)
    chains = [chain(store, 2, salt=s) for s in range(4)]
    for keys in chains:
        store.put(keys, blocks_for(keys))  # host evictions try to demote; the disk fails
    stats = store.stats()
    assert stats["disk"]["errors"] >= 1
    assert stats["disk"]["num_blocks"] == 0
    assert torch.equal(store.get(chains[-1]), blocks_for(chains[-1]))  # host still serves
    store.check_integrity()
    failing["on"] = False
    more = chain(store, 2, salt=9)
    store.put(more, blocks_for(more))
    assert store.stats()["disk"]["num_blocks"] == 2  # the disk works again
    store.check_integrity()
    store.close()


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a real filesystem that runs out of space."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                          capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _fill(fs: Path) -> Path:
    """Take every free block of ``fs`` (the slab is preallocated; the catalog has to grow)."""
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def test_a_write_through_put_the_full_disk_cannot_take_raises_and_keeps_nothing(tiny_fs: Path) -> None:
    store = make_store(tiny_fs, host_blocks=4, disk_blocks=16, write_policy="write_through")
    filler = _fill(tiny_fs)
    keys = chain(store, 2)
    with pytest.raises(TierFullError, match=r"put not acknowledged under write-through: 2 of 2 blocks did not "
                                            r"reach disk: catalog at .*: no space left on device"):
        store.put(keys, blocks_for(keys))
    assert store.lookup(keys).num_blocks == 0  # not acknowledged, and not kept in host RAM either
    assert store.stats()["disk"]["errors"] >= 1
    store.check_integrity()
    filler.unlink()
    store.put(keys, blocks_for(keys))  # acknowledged: on disk before it returned
    assert [store.view.block_info(k)["tiers"] for k in keys] == [["host", "disk"]] * 2  # type: ignore[index]
    store.check_integrity()
    store.close()


def test_a_put_that_waited_on_a_failed_write_through_writes_the_blocks_itself(tiny_fs: Path) -> None:
    """Two puts of one chain: the first one's disk write (outside the store lock) meets a full
    disk; the second, which waited for it, then finds the chain absent and writes it."""
    store = make_store(tiny_fs, host_blocks=4, disk_blocks=16, write_policy="write_through")
    filler = _fill(tiny_fs)
    disk = store.level("disk")
    write, inside, gate = disk.write, threading.Event(), threading.Event()  # type: ignore[union-attr]

    def held_then_freed(*args: Any) -> bool:
        if inside.is_set():
            return bool(write(*args))
        inside.set()
        assert gate.wait(30)
        try:
            return bool(write(*args))  # the disk is full: this write fails
        finally:
            filler.unlink()  # room for the put that waited

    disk.write = held_then_freed  # type: ignore[union-attr,method-assign]
    keys = chain(store, 2)
    first, first_errors = started(lambda: store.put(keys, blocks_for(keys)))
    assert inside.wait(30)
    second, second_errors = started(lambda: store.put(keys, blocks_for(keys)))
    wait_blocked(second, *WRITE_WAITS, what="a second put of the keys being written")
    assert second.is_alive()  # waiting for the first put's write
    gate.set()
    first.join(30)
    second.join(30)
    assert len(first_errors) == 1 and isinstance(first_errors[0], TierFullError)
    assert "put not acknowledged under write-through: 2 of 2 blocks did not reach disk" in str(first_errors[0])
    assert not second_errors
    assert [store.view.block_info(k)["tiers"] for k in keys] == [["host", "disk"]] * 2  # type: ignore[index]
    assert torch.equal(store.get(keys), blocks_for(keys))
    store.check_integrity()
    store.close()


def _pinned_full_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A write-through store whose 2-slot disk holds 2 pinned blocks: nothing it can evict."""
    store = make_store(tmp_path, host_blocks=4, disk_blocks=2, write_policy="write_through")
    held = chain(store, 2, salt=1)
    store.put(held, blocks_for(held))
    store.pin(held)
    return store, held


def test_a_write_through_put_with_no_evictable_disk_slot_raises_capacity_error(tmp_path: Path) -> None:
    store, held = _pinned_full_disk(tmp_path)
    keys = chain(store, 1)
    with pytest.raises(CapacityError, match=r"put not acknowledged under write-through: 1 of 1 blocks did not "
                                            r"reach disk: need 1 disk slots, 0 free of 2 \(the rest pinned"):
        store.put(keys, blocks_for(keys))
    assert store.lookup(keys).num_blocks == 0
    store.check_integrity()
    store.unpin(held)
    store.put(keys, blocks_for(keys))
    assert store.view.block_info(keys[0])["tiers"] == ["host", "disk"]  # type: ignore[index]
    store.check_integrity()
    store.close()


def test_a_write_through_commit_that_cannot_reach_disk_publishes_nothing(tmp_path: Path) -> None:
    store, _held = _pinned_full_disk(tmp_path)
    keys = chain(store, 1)
    slots = store.host_leases.reserve(1)
    payload = store.layout.bytes_per_block
    store.level("host").tier.pool[slots[0], :payload].copy_(blocks_for(keys).view(torch.uint8).reshape(-1))  # type: ignore[union-attr]
    with pytest.raises(CapacityError, match="put not acknowledged under write-through"):
        store.host_leases.commit(keys, slots)
    assert store.lookup(keys).num_blocks == 0
    store.host_leases.cancel(slots)  # the slots stayed reserved, as the daemon expects when a commit raises
    store.check_integrity()
    store.close()


def test_a_batch_the_disk_tier_refuses_frees_its_slots(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=2, disk_blocks=8)
    disk = store.level("disk")
    entry = BlockEntry(b"k" * 32, None, "t" * 300, 0.0, [None, None])  # a tenant no catalog records
    slots = disk.allocate(1)  # type: ignore[union-attr]
    row = torch.zeros(disk.raw_bytes, dtype=torch.uint8)  # type: ignore[union-attr]
    assert disk.write([entry], slots, [row]) is False  # type: ignore[union-attr]
    assert (disk.num_free, disk.tier.num_reserved, disk.counters.errors) == (8, 0, 1)  # type: ignore[union-attr]
    store.check_integrity()
    store.close()


def test_a_catalog_that_cannot_drop_during_eviction_keeps_the_index_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=8)
    keys = [k for s in range(12) for k in chain(store, 1, salt=s)]
    for key in keys:
        store.put([key], blocks_for([key]))  # host holds 4, the disk the 8 before them
    on_disk = [k for k in keys if store.lookup([k]).tiers == ("disk",)]
    assert len(on_disk) == 8

    def fail(self: object, keys: object) -> None:
        raise TierFullError("catalog at X: no space left on device (injected)")

    monkeypatch.setattr(catalog_module.Catalog, "delete", fail)
    more = chain(store, 1, salt=12)
    store.put(more, blocks_for(more))  # a host victim finds no room on disk: it is dropped
    assert store.stats()["disk"]["errors"] == 1 and store.stats()["disk"]["evictions"] == 0
    store.check_integrity()
    with pytest.raises(TierFullError, match="injected"):
        store.delete(on_disk[:1])
    store.check_integrity()
    assert [store.lookup([k]).tiers for k in on_disk] == [("disk",)] * 8  # all still there, whole
    for key in on_disk:
        assert torch.equal(store.get([key]), blocks_for([key]))
    store.check_integrity()
    monkeypatch.undo()
    later = chain(store, 8, salt=13)
    store.put(later, blocks_for(later))  # the disk evicts again
    assert store.stats()["disk"]["evictions"] > 0
    store.check_integrity()
    store.close()
