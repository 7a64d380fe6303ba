"""TieredStore under faults: kill -9 mid-put, flipped bytes in the slab, a failing disk."""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from factories import blocks_for, chain, make_store

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
    time.sleep(3600)  # wait for the kill


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
        time.sleep(rng.uniform(0.0, 0.25))
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
    slots = {k: store.block_info(k)["slots"]["disk"] for keys in chains for k in keys}  # type: ignore[index]
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
    import tiers.slab as slab_module

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
