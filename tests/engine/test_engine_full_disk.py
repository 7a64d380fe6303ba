"""A full disk, for real: an engine (and a daemon) whose disk tier lives on a small ext4
filesystem, a loop-mounted image, that a ballast file fills while the engine writes through
and demotes.

What fills is the room the LMDB catalog needs to grow: the slab is preallocated at open
(``posix_fallocate``), so a full disk reaches the tier in operation as ENOSPC at a catalog
commit (``TierFullError``, docs/storage-format.md), after the slots' payloads were written.
Why ext4 on a loop device rather than a tmpfs: a real block device's filesystem (journal,
extents, O_DIRECT to the device, blocks freed by a delete only once its journal commits),
the closest to the NVMe drive the tier is made for; a machine without loop devices gets a
tmpfs instead.

Held: no exception reaches the engine's caller or the client; the engine's greedy tokens are
those of an engine with no store; the refusals and failed demotions are counted, once each;
with room again the disk takes writes; after a restart the catalog agrees with the slab and
every block it holds reads back the bytes the engine put under its key.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import CapacityError, StoreConfig, TieredStore, TierFullError
from kvstore.engine import LLMEngine, SamplingParams
from kvstore.tiers.disk import DiskTier
from tests.daemon.daemon_helpers import DaemonProc, blocks, prompt
from tests.engine.conftest import make_engine
from tests.factories import require

FS_BYTES = 16 << 20
TINY = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
            vocab_size=128)  # 2,048-byte blocks of 4 tokens: one 4 KiB slot each
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
# 6 prefixes of 4 blocks, each followed by 3 to 7 tokens of its own: prefixes repeat every 6
PREFIXES = [[7 * p + i for i in range(3, 19)] for p in range(6)]
PROMPTS = [PREFIXES[i % 6] + [60 + (5 * i + j) % 60 for j in range(3 + i % 5)] for i in range(48)]
ROOM, FULL, FREED = PROMPTS[:6], PROMPTS[6:30], PROMPTS[30:]
# a device pool, host tier and disk tier small enough that blocks leave the device and host and
# come back (the disk large enough that it never evicts: what it acknowledged must survive)
SIZES = dict(kv_cache_bytes=24 * 2048, host_bytes=12 * 4096, disk_bytes=256 * 4096)


@pytest.fixture
def small_ext4(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB ext4 filesystem in a loop-mounted image file, mounted here as root; where the
    machine has no loop device or no mkfs.ext4 (a container), a 16 MiB tmpfs, a real
    filesystem that fills too. CI runs as root: a machine that can mount neither fails
    there, and skips elsewhere."""
    image, mount_point = tmp_path / "ext4.img", tmp_path / "mnt"
    mount_point.mkdir()
    with open(image, "wb") as f:
        f.truncate(FS_BYTES)
    ext4, why = False, "mkfs.ext4 is not installed (Debian: e2fsprogs)"
    if shutil.which("mkfs.ext4"):
        made = subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", str(image)], capture_output=True, text=True,
                              check=False)  # 4 KiB blocks, as on an NVMe drive's filesystem
        why = f"mkfs.ext4 failed: {made.stderr.strip()}"
        if made.returncode == 0:
            mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mount_point)], capture_output=True,
                                     text=True, check=False)
            ext4, why = mounted.returncode == 0, f"cannot loop-mount an ext4 image here: {mounted.stderr.strip()}"
    if not ext4:
        tmpfs = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mount_point)],
                               capture_output=True, text=True, check=False)
        require(tmpfs.returncode == 0, f"{why}; and cannot mount a tmpfs: {tmpfs.stderr.strip()}")
    yield mount_point
    if subprocess.run(["umount", str(mount_point)], capture_output=True, check=False).returncode != 0:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)  # detaches the loop device once free


def fill(fs: Path) -> Path:
    """Take every free block of ``fs`` with a ballast file."""
    ballast = fs / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        for size in (1 << 20, 4096):
            try:
                while True:
                    f.write(bytes(size))
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    return ballast


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """Every prompt's greedy tokens from an engine with no store and no prefix cache."""
    llm = make_engine(None, random_model=TINY, host_bytes=0, enable_prefix_caching=False)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.close()


class RecordedPuts:
    """The engine's store with its ``put`` recorded: every payload offered under each key (the
    only way bytes enter the store), and the keys of the puts that returned (acknowledged)."""

    def __init__(self, store: TieredStore) -> None:
        self.payloads: dict[bytes, list[torch.Tensor]] = {}
        self.acknowledged: set[bytes] = set()
        put = store.put

        def recorded(keys: list[bytes], data: torch.Tensor, **kwargs: Any) -> None:
            for key, block in zip(keys, data, strict=True):
                self.payloads.setdefault(key, []).append(block.clone())
            put(keys, data, **kwargs)
            self.acknowledged.update(keys)

        store.put = recorded  # type: ignore[method-assign]


def disk_engine(fs: Path, write_policy: str) -> LLMEngine:
    return make_engine(None, random_model=TINY, disk_path=fs / "kv", write_policy=write_policy, **SIZES)


def generate(llm: LLMEngine, prompts: list[list[int]], expected: list[list[int]]) -> dict[str, int]:
    """Run ``prompts`` 8 at a time; assert each gives the store-less engine's tokens; the
    tokens each tier served, summed."""
    served = {"device": 0, "host": 0, "disk": 0}
    for start in range(0, len(prompts), 8):
        batch = prompts[start : start + 8]
        outs = llm.generate(batch, GREEDY)
        for p, out in zip(batch, outs, strict=True):
            assert out.token_ids == expected[PROMPTS.index(p)], f"prompt {PROMPTS.index(p)} generated other tokens"
            for tier, n in out.metrics.cached_tokens.items():
                served[tier] += n
    llm.check_integrity()
    return served


def counters(llm: LLMEngine) -> dict[str, int]:
    """What the test watches: the engine's blocks the store refused, the store's disk errors
    and hits, the disk tier's failed write batches and blocks held."""
    assert llm.block_manager.demoter is not None
    llm.block_manager.demoter.drain()  # the background puts of every step so far are settled
    stats = llm.stats()
    tier = llm.store.level("disk").tier.stats()  # type: ignore[union-attr]
    assert tier["num_reserved"] == 0
    return {"dropped": stats["device"]["dropped"], "errors": stats["disk"]["errors"],
            "disk_hits": stats["disk"]["hits"], "evictions": stats["disk"]["evictions"],
            "failed_writes": tier["failed_writes"], "on_disk": tier["num_used"]}


def check_restart(config: StoreConfig, recorded: RecordedPuts, acknowledged_on_disk: bool) -> int:
    """Open the disk directory in a new store: the catalog agrees with the slab, every block it
    holds reads back a payload the engine put under its key (and, ``acknowledged_on_disk``,
    every acknowledged put is there). Returns the number of blocks found."""
    store = TieredStore(config)
    try:
        store.check_integrity()
        found = [key for key, _, _ in store.view.held_by_tier()["disk"]]
        assert found, "nothing on disk after the restart"
        wrong = [key.hex() for key in found
                 if not any(torch.equal(store.get([key])[0], p) for p in recorded.payloads.get(key, []))]
        assert not wrong, f"{len(wrong)} of {len(found)} blocks read other bytes than were put, first {wrong[0]}"
        if acknowledged_on_disk:
            lost = recorded.acknowledged - set(found)
            assert not lost, f"{len(lost)} acknowledged blocks are not on disk after the restart"
        assert store.stats()["disk"]["errors"] == 0
        store.check_integrity()
        return len(found)
    finally:
        store.close()


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_an_engine_whose_disk_fills_keeps_serving_and_restarts_whole(
    small_ext4: Path, expected: list[list[int]], write_policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    llm = disk_engine(small_ext4, write_policy)
    config = llm.store.config  # type: ignore[union-attr]
    recorded = RecordedPuts(llm.store)  # type: ignore[arg-type]
    try:
        assert llm.store.level("disk").tier.direct_io  # type: ignore[union-attr]
        generate(llm, ROOM, expected)
        room = counters(llm)
        assert room["on_disk"] > 0 and room["failed_writes"] == room["errors"] == room["dropped"] == 0

        ballast = fill(small_ext4)
        served = generate(llm, FULL, expected)
        assert llm.evict_device_cache() > 0  # its puts meet the full disk too, and raise nothing
        full = counters(llm)
        assert served["host"] + served["disk"] > 0 and full["disk_hits"] > room["disk_hits"]  # fetched back
        assert full["failed_writes"] > 0, "the disk never refused a write"
        assert full["errors"] == full["failed_writes"], "each failed write batch counts once"
        last_error = llm.store.level("disk").last_error  # type: ignore[union-attr]
        # ENOSPC, or LMDB's EIO for a write the filling filesystem cut short: both are a full disk
        assert isinstance(last_error, TierFullError) and "no space left on device" in str(last_error)
        if write_policy == "write_through":  # a put the disk refused is not acknowledged: the engine drops it
            assert full["dropped"] > 0
        else:  # puts land in host RAM; what failed is host's demotions to disk
            assert full["dropped"] == 0
        # a full disk is a refusal, counted: not a failure logged with its traceback at every put
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        llm.store.check_integrity()  # type: ignore[union-attr]

        ballast.unlink()
        generate(llm, FREED, expected)
        freed = counters(llm)
        assert freed["on_disk"] > full["on_disk"], "the disk took no block once it had room again"
        assert freed["failed_writes"] == full["failed_writes"] and freed["errors"] == full["errors"]
        assert freed["evictions"] == 0
        llm.store.check_integrity()  # type: ignore[union-attr]
    finally:
        llm.close()  # the device cache written back, the store closed

    found = check_restart(config, recorded, acknowledged_on_disk=write_policy == "write_through")
    assert found >= freed["on_disk"]

    llm = disk_engine(small_ext4, write_policy)
    try:
        served = generate(llm, PROMPTS[:12], expected)
        assert served["disk"] > 0, "the restarted engine found nothing on disk"
        llm.store.check_integrity()  # type: ignore[union-attr]
    finally:
        llm.close()


def test_an_engine_closed_while_its_disk_is_full_raises_nothing_and_restarts_whole(
    small_ext4: Path, expected: list[list[int]]
) -> None:
    # Regression: under write-through, the synchronous puts of evict_device_cache() and close()
    # raised the disk's TierFullError to the caller, and close() then left the store open.
    llm = disk_engine(small_ext4, "write_through")
    config = llm.store.config  # type: ignore[union-attr]
    recorded = RecordedPuts(llm.store)  # type: ignore[arg-type]
    try:
        generate(llm, ROOM, expected)
        ballast = fill(small_ext4)
        generate(llm, FULL[:8], expected)
        assert llm.evict_device_cache() > 0
        generate(llm, FULL[8:16], expected)
        full = counters(llm)
        assert full["dropped"] > 0 and full["failed_writes"] > 0
    finally:
        llm.close()  # writes the device cache back to the full disk: refused, counted, not raised
    ballast.unlink()
    check_restart(config, recorded, acknowledged_on_disk=True)


def test_a_daemon_whose_disk_fills_refuses_puts_as_capacity_and_loses_nothing_acknowledged(
    small_ext4: Path,
) -> None:
    # Socket puts (no shared memory): a put returns once the daemon acknowledged it, so the
    # client knows exactly which puts were refused.
    daemon = DaemonProc(small_ext4 / "data", "--no-shm", "--max-namespaces", "1", "--write-policy", "write_through",
                        host_mem="256KiB", disk="2MiB")
    acknowledged: list[list[bytes]] = []
    refused: list[list[bytes]] = []
    try:
        client = daemon.connect()
        try:
            chains = [client.block_keys(prompt(salt, 2)) for salt in range(60)]
            for keys in chains[:10]:
                client.put(keys, blocks(keys))
                acknowledged.append(keys)
            ballast = fill(small_ext4)
            for keys in chains[10:50]:
                try:
                    client.put(keys, blocks(keys))
                    acknowledged.append(keys)
                except CapacityError as e:  # the documented error of a full disk, on a live connection
                    assert "no space left on device" in str(e), e
                    refused.append(keys)
                    assert client.lookup(keys).num_blocks == 0  # not acknowledged, not kept
            assert refused, "the full disk refused no put"
            assert client.stats()["disk"]["errors"] > 0
            ballast.unlink()
            for keys in chains[50:]:
                client.put(keys, blocks(keys))
                acknowledged.append(keys)
        finally:
            client.close()
        assert daemon.stop() == 0
        daemon.start()  # a restart on the same data directory
        client = daemon.connect()
        try:
            for keys in acknowledged:
                assert client.lookup(keys).tiers == ("disk", "disk"), "an acknowledged put was lost"
                assert torch.equal(client.get(keys), blocks(keys))
            for keys in refused:
                assert client.lookup(keys).num_blocks == 0
        finally:
            client.close()
        assert daemon.stop() == 0
        assert "Traceback" not in daemon.output, daemon.output[-3000:]
    finally:
        if daemon.proc.poll() is None:
            daemon.kill9()


def test_a_catalog_commit_the_filling_filesystem_cuts_short_is_a_full_disk(small_ext4: Path) -> None:
    # Regression: LMDB reports a write the filesystem cut short as EIO (mdb_page_flush: "short
    # write, filesystem full?"), which the catalog raised as TierIOError: a failing medium, the
    # daemon's STORAGE, where the disk was only full (TierFullError, the daemon's CAPACITY).
    tier = DiskTier(small_ext4 / "d", 512 * 4096, 4096)
    keys = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(210)]
    payloads = [torch.full((4096,), i % 251, dtype=torch.uint8) for i in range(210)]

    def put(start: int, stop: int) -> None:
        slots = tier.allocate(stop - start)
        tier.write(keys[start:stop], slots, payloads[start:stop], ["t"] * (stop - start), "L" * 64)

    try:
        put(0, 10)
        spare = small_ext4 / "spare"
        spare.write_bytes(bytes(16384))
        ballast = fill(small_ext4)
        spare.unlink()  # 4 pages free: the new catalog pages of 200 entries start to fit, then do not
        with pytest.raises(TierFullError, match=r"no space left on device \(mdb_txn_commit: Input/output error"):
            put(10, 210)
        assert (tier.num_used, tier.num_reserved, tier.stats()["failed_writes"]) == (10, 0, 1)
        tier.check_integrity()
        ballast.unlink()
        put(10, 210)
        outs = [torch.empty(4096, dtype=torch.uint8) for _ in keys]
        by_key = {e.key: e.slot for e in tier.entries()}
        assert tier.read(keys, [by_key[k] for k in keys], outs) == [True] * len(keys)
        assert all(torch.equal(out, p) for out, p in zip(outs, payloads, strict=True))
        tier.check_integrity()
    finally:
        tier.close()
