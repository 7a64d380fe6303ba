"""DiskTier under faults: corrupt slots, ENOSPC and EIO, a tiny filesystem, a full LMDB map,
bad input, use after close and after fork."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvstore.tiers.catalog as catalog_module
import kvstore.tiers.slab as slab_module
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.errors import TierError, TierFullError, TierIOError

PAYLOAD = 6000
SLOT = 8192


def make_key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def payload_for(key: bytes, size: int = PAYLOAD) -> torch.Tensor:
    return torch.frombuffer(bytearray(hashlib.shake_128(key).digest(size)), dtype=torch.uint8)


def put(tier: DiskTier, keys: list[bytes]) -> list[int]:
    slots = tier.allocate(len(keys))
    tier.write(keys, slots, [payload_for(k, tier.payload_bytes) for k in keys], ["t"] * len(keys), "L")
    return slots


def read_all(tier: DiskTier, keys: list[bytes], slots: list[int]) -> list[bool]:
    outs = [torch.zeros(tier.payload_bytes, dtype=torch.uint8) for _ in keys]
    flags = tier.read(keys, slots, outs)
    for key, out, good in zip(keys, outs, flags, strict=True):
        if good:
            assert torch.equal(out, payload_for(key, tier.payload_bytes))
    return flags


def flip_byte(tmp_path: Path, offset: int) -> None:
    with open(tmp_path / "d" / "slab-000.bin", "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def test_flipped_bytes_read_false_and_leave_the_catalog(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 16 * SLOT, PAYLOAD)
    keys = [make_key(i) for i in range(6)]
    slots = put(tier, keys)
    flip_byte(tmp_path, slots[2] * SLOT + 17)
    flip_byte(tmp_path, slots[4] * SLOT + PAYLOAD - 1)
    flip_byte(tmp_path, slots[5] * SLOT + PAYLOAD + 5)  # padding: not payload, still good
    assert read_all(tier, keys, slots) == [True, True, False, True, False, True]
    assert tier.errors == 2 and tier.stats()["corrupt_reads"] == 2
    assert {e.key for e in tier.entries()} == {keys[i] for i in (0, 1, 3, 5)}
    assert tier.num_used == 4 and tier.num_free == 12
    tier.check_integrity()
    tier.close()
    tier = DiskTier(tmp_path / "d", 16 * SLOT, PAYLOAD)
    assert tier.num_used == 4
    assert read_all(tier, [keys[0], keys[5]], [slots[0], slots[5]]) == [True, True]
    tier.close()


def test_block_in_the_wrong_slot_fails_because_the_key_is_checksummed(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    keys = [make_key(i) for i in range(2)]
    slots = put(tier, keys)
    tier.close()
    slab = tmp_path / "d" / "slab-000.bin"
    data = bytearray(slab.read_bytes())
    data[slots[1] * SLOT : (slots[1] + 1) * SLOT] = data[slots[0] * SLOT : (slots[0] + 1) * SLOT]
    slab.write_bytes(bytes(data))
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    assert read_all(tier, keys, slots) == [True, False]
    assert tier.errors == 1
    tier.close()


def test_read_of_a_slot_holding_no_block_is_false(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    assert read_all(tier, [make_key(1)], [3]) == [False]
    assert tier.errors == 1
    tier.check_integrity()
    tier.close()


@pytest.mark.parametrize(
    ("call", "err", "expected"),
    [
        ("pwritev", errno.ENOSPC, TierFullError),
        ("pwritev", errno.EIO, TierIOError),
        ("fdatasync", errno.EIO, TierIOError),
        ("fdatasync", errno.ENOSPC, TierFullError),
    ],
)
def test_write_failure_commits_nothing_and_frees_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, err: int, expected: type[TierError]
) -> None:
    tier = DiskTier(tmp_path / "d", 16 * SLOT, PAYLOAD)
    kept = [make_key(100)]
    kept_slots = put(tier, kept)

    def fail(*args: object) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(slab_module.os, call, fail)
    keys = [make_key(i) for i in range(4)]
    with pytest.raises(expected, match=r"writing 4 blocks \(24000 bytes\)"):
        put(tier, keys)
    monkeypatch.undo()
    assert {e.key for e in tier.entries()} == set(kept)
    assert (tier.num_used, tier.num_free, tier.num_reserved) == (1, 15, 0)
    assert tier.errors == 1
    tier.check_integrity()
    slots = put(tier, keys)  # the tier keeps working
    assert read_all(tier, keys + kept, slots + kept_slots) == [True] * 5
    tier.close()


def test_catalog_failure_commits_nothing_and_frees_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)

    def fail(*args: object) -> None:
        raise TierIOError("catalog at X: transaction failed (injected)")

    monkeypatch.setattr(catalog_module.Catalog, "put_batch", fail)
    with pytest.raises(TierIOError, match="injected"):
        put(tier, [make_key(1), make_key(2)])
    monkeypatch.undo()
    assert (tier.num_used, tier.num_free) == (0, 8)
    tier.check_integrity()
    tier.close()


def test_lmdb_map_grows_when_full(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 3000 * 4096, 100, map_bytes=64 * 1024, sync=False)
    keys = [make_key(i) for i in range(3000)]
    slots: list[int] = []
    for start in range(0, 3000, 500):
        slots += put(tier, keys[start : start + 500])
    assert tier.num_used == 3000
    tier.close()
    tier = DiskTier(tmp_path / "d", 3000 * 4096, 100, map_bytes=64 * 1024)
    assert tier.num_used == 3000
    assert read_all(tier, keys[::97], slots[::97]) == [True] * len(keys[::97])
    tier.check_integrity()
    tier.close()


def test_lmdb_map_that_may_not_grow_is_a_clear_error(tmp_path: Path) -> None:
    tier = DiskTier(
        tmp_path / "d", 3000 * 4096, 100, map_bytes=64 * 1024, max_map_bytes=128 * 1024, sync=False
    )
    with pytest.raises(TierFullError, match=r"may not grow past max_map_bytes=131072"):
        for start in range(0, 3000, 500):
            put(tier, [make_key(i) for i in range(start, start + 500)])
    assert tier.num_reserved == 0
    tier.check_integrity()
    tier.close()


def mount_tmpfs(mount_point: Path, options: str) -> Iterator[Path]:
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {done.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    yield from mount_tmpfs(tmp_path / "tiny", "size=2m")


@pytest.fixture
def read_only_fs(tmp_path: Path) -> Iterator[Path]:
    yield from mount_tmpfs(tmp_path / "ro", "ro,size=1m")


def test_unwritable_parent_is_a_clear_error(read_only_fs: Path) -> None:
    with pytest.raises(TierError, match=r"cannot create disk tier directory .*/ro/d: Read-only file system"):
        DiskTier(read_only_fs / "d", 8 * SLOT, PAYLOAD)


def test_slab_larger_than_the_filesystem_is_refused_at_open(tiny_fs: Path) -> None:
    with pytest.raises(
        TierFullError,
        match=r"cannot preallocate 4194304 bytes for .*slab-000.bin: the filesystem has \d+ bytes free",
    ):
        DiskTier(tiny_fs / "d", 4 << 20, 4096)
    tier = DiskTier(tiny_fs / "d", 1 << 20, 4096)  # the failed open left nothing behind
    assert tier.num_slots == 256
    tier.close()


def test_full_filesystem_fails_the_batch_then_recovers(tiny_fs: Path) -> None:
    tier = DiskTier(tiny_fs / "d", 1 << 20, 4096)
    keys = [make_key(i) for i in range(200)]
    slots = put(tier, keys[:10])
    filler = tiny_fs / "filler"
    with open(filler, "wb", buffering=0) as f:  # take every block the slab did not preallocate
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    with pytest.raises(TierFullError):
        for start in range(10, 200, 10):  # the catalog must grow its file at some point
            slots += put(tier, keys[start : start + 10])
    num_written = len(slots)
    assert tier.num_used == num_written and tier.num_reserved == 0
    tier.check_integrity()
    filler.unlink()
    slots += put(tier, keys[num_written : num_written + 10])
    assert read_all(tier, keys[: len(slots)], slots) == [True] * len(slots)
    tier.close()


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(TierError, match=r"parent directory .*missing does not exist"):
        DiskTier(tmp_path / "missing" / "d", 8 * SLOT, PAYLOAD)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(TierError, match=r"file: it exists and is not a directory"):
        DiskTier(tmp_path / "file", 8 * SLOT, PAYLOAD)
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    with pytest.raises(TierError, match=r"is already open \(lock held by pid \d+\)"):
        DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    tier.close()


def test_bad_geometry(tmp_path: Path) -> None:
    with pytest.raises(TierFullError, match=r"capacity 8000 bytes is smaller than one slot \(8192 bytes"):
        DiskTier(tmp_path / "d", 8000, PAYLOAD)
    with pytest.raises(ValueError, match="payload_bytes must be a positive int"):
        DiskTier(tmp_path / "d", 8 * SLOT, 0)
    DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD).close()
    with pytest.raises(
        TierError, match=r"holds payload_bytes=6000 \(slot_bytes=8192\) but was opened with payload_bytes=100"
    ):
        DiskTier(tmp_path / "d", 8 * SLOT, 100)


def test_shrinking_capacity_drops_entries_beyond_it(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 10 * SLOT, PAYLOAD)
    keys = [make_key(i) for i in range(10)]
    slots = put(tier, keys)
    tier.close()
    tier = DiskTier(tmp_path / "d", 5 * SLOT, PAYLOAD)
    assert tier.num_dropped_on_open == 5
    assert {e.slot for e in tier.entries()} == {0, 1, 2, 3, 4}
    tier.close()
    tier = DiskTier(tmp_path / "d", 10 * SLOT, PAYLOAD)  # growing back does not resurrect them
    assert tier.num_used == 5 and tier.num_free == 5
    assert read_all(tier, keys[:5], slots[:5]) == [True] * 5
    tier.close()


def test_bad_batches(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    key = make_key(0)
    slots = tier.allocate(2)
    good = payload_for(key)
    cases: list[tuple[tuple[object, ...], str]] = [
        (([key], slots, [good], ["t"], "L"), "got 1 keys, 2 slots, 1 payloads, 1 tenants"),
        (
            ([key], slots[:1], [good[:100]], ["t"], "L"),
            "payload of 100 bytes is shorter than payload_bytes=6000",
        ),
        (([b""], slots[:1], [good], ["t"], "L"), "keys must be bytes of 1 to 64 bytes"),
        (([b"k" * 65], slots[:1], [good], ["t"], "L"), "keys must be bytes of 1 to 64 bytes"),
        ((["text"], slots[:1], [good], ["t"], "L"), "keys must be bytes"),
        (([key, key], slots, [good, good], ["t", "t"], "L"), "same key twice"),
        (([key], [7], [good], ["t"], "L"), "slot 7: it is free, not reserved"),
        (([key], slots[:1], [good], ["t" * 300], "L"), "at most 255 UTF-8 bytes"),
        (([key], slots[:1], [good.to(torch.float32)[::2]], ["t"], "L"), "contiguous"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            tier.write(*args)  # type: ignore[arg-type]
    assert tier.num_reserved == 2, "a rejected batch leaves its reservations alone"
    with pytest.raises(ValueError, match="got 1 keys, 2 slots, 1 outs"):
        tier.read([key], slots, [good])
    with pytest.raises(ValueError, match="out of 10 bytes is shorter"):
        tier.read([key], slots[:1], [torch.zeros(10, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="read-only"):
        tier.read([key], slots[:1], [memoryview(bytes(PAYLOAD))])
    with pytest.raises(ValueError, match="out of range"):
        tier.read([key], [8], [torch.zeros(PAYLOAD, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="cannot allocate -1"):
        tier.allocate(-1)
    tier.close()


def test_use_after_close(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    tier.close()
    calls = [
        lambda: tier.allocate(1),
        lambda: tier.release([0]),
        lambda: tier.write([make_key(0)], [0], [payload_for(make_key(0))], ["t"], "L"),
        lambda: tier.read([make_key(0)], [0], [torch.zeros(PAYLOAD, dtype=torch.uint8)]),
        lambda: tier.delete([make_key(0)]),
        lambda: tier.touch([make_key(0)]),
        lambda: tier.flush(),
        lambda: list(tier.entries()),
        lambda: tier.check_integrity(),
    ]
    for call in calls:
        with pytest.raises(TierError, match=r"disk tier at .* is closed"):
            call()
    tier.close()


def test_use_after_fork_is_refused_in_the_child(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    keys = [make_key(0)]
    slots = put(tier, keys)
    pid = os.fork()
    if pid == 0:  # child: every call must refuse, and close must not touch LMDB
        code = 0
        try:
            tier.read(keys, slots, [torch.zeros(PAYLOAD, dtype=torch.uint8)])
            code = 1
        except TierError as e:
            code = 0 if "after fork" in str(e) else 2
        try:
            tier.allocate(1)
            code = 3
        except TierError:
            pass
        tier.close()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert read_all(tier, keys, slots) == [True]  # the parent is unaffected
    put(tier, [make_key(1)])
    tier.check_integrity()
    tier.close()


def test_a_truncated_catalog_is_refused_at_open_not_a_crash(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 64 * SLOT, PAYLOAD, sync=False)
    put(tier, [make_key(i) for i in range(64)])
    tier.close()
    data = tmp_path / "d" / "catalog" / "data.mdb"
    assert data.stat().st_size > 4 * 4096
    os.truncate(data, 2 * 4096)  # both meta pages survive; the pages they point into do not
    pid = os.fork()  # LMDB maps the file: opening it could kill the process with SIGBUS
    if pid == 0:
        try:
            DiskTier(tmp_path / "d", 64 * SLOT, PAYLOAD).close()
            os._exit(1)
        except TierIOError:
            os._exit(0)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the open ended with status {os.waitstatus_to_exitcode(status)}"
    with pytest.raises(TierIOError, match=r"LMDB catalog file .*data.mdb is truncated: 8192 bytes, its newest "
                                          r"meta page needs \d+ \(\d+ pages of 4096\)"):
        DiskTier(tmp_path / "d", 64 * SLOT, PAYLOAD)
    # the refused open let the directory go: deleting the catalog starts it afresh
    shutil.rmtree(data.parent)
    tier = DiskTier(tmp_path / "d", 64 * SLOT, PAYLOAD)
    assert tier.num_used == 0
    tier.close()


def test_eio_on_one_slot_is_isolated_from_its_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    keys = [make_key(i) for i in range(5)]
    slots = put(tier, keys)
    real = os.preadv
    bad_offset = slots[3] * SLOT

    def failing(fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset <= bad_offset < offset + sum(len(b) for b in buffers):
            raise OSError(errno.EIO, "injected media error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(slab_module.os, "preadv", failing)
    assert read_all(tier, keys, slots) == [True, True, True, False, True]
    monkeypatch.undo()
    assert tier.errors == 1
    assert keys[3] not in {e.key for e in tier.entries()}
    tier.check_integrity()
    tier.close()
