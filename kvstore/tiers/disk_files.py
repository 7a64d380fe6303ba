"""Opening a disk tier's directory: path checks, the owner lock, the catalog, the slab, and
the in-memory slot states rebuilt from the catalog (the catalog is the truth).

Directory layout (docs/storage-format.md)::

    <path>/tier.lock     flock'd by the one open DiskTier; holds its pid as text
    <path>/catalog/      LMDB environment (data.mdb, lock.mdb)
    <path>/slab-000.bin  the slab: num_slots * slot_bytes bytes, preallocated
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from kvstore.tiers.catalog import Catalog, initial_map_bytes
from kvstore.tiers.errors import TierError, TierFullError
from kvstore.tiers.records import decode_record
from kvstore.tiers.slab import ALIGN, Slab
from kvstore.tiers.slot_table import SlotTable


def drop_page_cache(path: str | os.PathLike[str]) -> None:
    """Drop a file's pages from the page cache, or those of every file below a folder, so
    that the next read comes from the disk (a no-op for pages O_DIRECT never cached)."""
    root = Path(path)
    for f in [root] if root.is_file() else [f for f in root.rglob("*") if f.is_file()]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _prepare_directory(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise TierError(f"cannot open disk tier at {path}: parent directory {parent} does not exist")
    if os.path.exists(path) and not os.path.isdir(path):
        raise TierError(f"cannot open disk tier at {path}: it exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise TierError(f"cannot create disk tier directory {path}: {e.strerror}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise TierError(f"cannot open disk tier at {path}: directory is not writable")


def _lock_directory(path: str) -> int:
    lock_path = os.path.join(path, "tier.lock")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise TierError(f"cannot open disk tier at {path}: {lock_path}: {e.strerror}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise TierError(f"disk tier at {path} is already open (lock held by pid {holder})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@dataclass
class TierFiles:
    """The open resources of one tier directory; ``close`` releases them in reverse order."""

    path: str
    lock_fd: int
    catalog: Catalog
    slab: Slab
    num_replaced: int = 0  # entries dropped because the directory held another payload size

    @classmethod
    def open(
        cls,
        path: str,
        capacity_bytes: int,
        payload_bytes: int,
        *,
        sync: bool,
        direct_io: bool,
        map_bytes: int | None,
        max_map_bytes: int,
        replaceable: Collection[int] = (),
        owners: Collection[str] = (),
    ) -> TierFiles:
        """Validate the geometry and open everything, or raise with nothing left open."""
        if isinstance(payload_bytes, bool) or not isinstance(payload_bytes, int) or payload_bytes <= 0:
            raise ValueError(f"payload_bytes must be a positive int, got {payload_bytes!r}")
        slot_bytes = -(-payload_bytes // ALIGN) * ALIGN
        num_slots = capacity_bytes // slot_bytes
        if num_slots < 1:
            raise TierFullError(
                f"disk capacity {capacity_bytes} bytes is smaller than one slot ({slot_bytes} bytes "
                f"for payload_bytes={payload_bytes})"
            )
        _prepare_directory(path)
        lock_fd = _lock_directory(path)
        catalog: Catalog | None = None
        try:
            catalog = Catalog(
                os.path.join(path, "catalog"),
                map_bytes=map_bytes or initial_map_bytes(num_slots),
                max_map_bytes=max_map_bytes,
                sync=sync,
            )
            num_replaced = catalog.check_geometry(payload_bytes, slot_bytes, num_slots, replaceable, owners)
            slab = Slab(
                os.path.join(path, "slab-000.bin"), num_slots, slot_bytes, payload_bytes, direct_io=direct_io
            )
        except BaseException:
            if catalog is not None:
                catalog.close()
            os.close(lock_fd)
            raise
        return cls(path, lock_fd, catalog, slab, num_replaced)

    def close(self) -> None:
        """Close slab, catalog and lock (only in the process that opened them)."""
        self.slab.close()
        self.catalog.close()
        os.close(self.lock_fd)


def load_slot_table(files: TierFiles) -> tuple[SlotTable, int]:
    """Rebuild slot states from the catalog; drop entries the slab cannot back.

    An entry is dropped when its value does not decode, its slot lies beyond the bytes the slab
    held before this open (capacity shrank, or the slab file was lost), or another entry already
    claimed its slot. Every slot that no kept entry names is free.

    Returns:
        The slot table and the number of entries dropped.
    """
    slab, catalog = files.slab, files.catalog
    table = SlotTable(slab.num_slots)
    stale: list[bytes] = []
    for key, value in catalog.iter_all():
        try:
            record = decode_record(value)
        except (TierError, UnicodeDecodeError):
            stale.append(key)
            continue
        if record.slot >= slab.num_surviving_slots or not table.adopt(record.slot, record.checksum):
            stale.append(key)
    if stale:
        catalog.write(lambda txn: [txn.delete(key, db=catalog.blocks) for key in stale])
    table.seal()
    return table, len(stale)
