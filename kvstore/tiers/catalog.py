"""The disk tier's catalog: an LMDB environment mapping block key -> slot record.

Two named databases live in one environment (byte-exact layout in docs/storage-format.md):
  * ``meta``: ``b"geometry"`` -> the slab geometry the directory was created with;
  * ``blocks``: block key (1..64 bytes) -> a fixed 45-byte header + layout id + tenant.

Every write goes through ``Catalog.write`` which retries the transaction after growing the
map on ``MapFullError``. The catalog is used by one process (the tier checks the pid) and
every call, reads included, is serialised by the tier's catalog lock, so ``set_mapsize``
never races an open transaction.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TypeVar

import lmdb

from kvstore.tiers.errors import TierError, TierFullError, TierIOError
from kvstore.tiers.records import FORMAT_VERSION, GEOMETRY, LAST_ACCESS_OFFSET, MAGIC, decode_record

_ENTRY_ESTIMATE_BYTES = 512  # generous: a 64-byte key and a ~100-byte value in half-full pages
# LMDB's longest write: MDB_COMMIT_PAGES (64) pages of its page size, the OS's. A commit that
# fails with less than this free may have been cut short by the full filesystem.
_COMMIT_RUN_BYTES = 64 * mmap.PAGESIZE
_T = TypeVar("_T")
_STAMP = struct.Struct("<d")

# LMDB 0.9's meta page (lmdb/mdb.c, 64-bit builds), one at page 0 and one at page 1:
#   0  MDB_page header (16 bytes)   16 mm_magic u32   20 mm_version u32
#   40 mm_dbs[FREE_DBI].md_pad u32: the page size     136 mm_last_pg u64   144 mm_txnid u64
_META_MAGIC, _META_VERSION = 0xBEEFC0DE, 1
_META_HEAD = struct.Struct("<II")  # at 16: magic, version
_META_PSIZE = struct.Struct("<I")  # at 40
_META_TAIL = struct.Struct("<QQ")  # at 136: last page number, transaction id
_META_BYTES = 152


def check_data_file(path: str) -> None:
    """Refuse an LMDB data file shorter than its newest meta page says: mapping it would die
    of SIGBUS at the first touch of a page past the end (a truncated or half-copied file).

    A missing or empty file (a new environment), or one whose meta pages this reader does not
    know, is left to LMDB, which reports what it finds as an error.

    Raises:
        TierIOError: naming the file, its size and the size its meta page needs.
    """
    if struct.calcsize("P") != 8:  # the offsets above are a 64-bit build's
        return
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = f.read(_META_BYTES)
            if len(first) < _META_BYTES or _META_HEAD.unpack_from(first, 16) != (_META_MAGIC, _META_VERSION):
                return
            psize = _META_PSIZE.unpack_from(first, 40)[0]
            if psize < _META_BYTES or psize & (psize - 1):
                return
            f.seek(psize)
            second = f.read(_META_BYTES)
    except FileNotFoundError:
        return
    except OSError as e:
        raise TierIOError(f"cannot read the LMDB catalog file {path}: {e}") from e
    metas = [_META_TAIL.unpack_from(page, 136) for page in (first, second)
             if len(page) == _META_BYTES and _META_HEAD.unpack_from(page, 16) == (_META_MAGIC, _META_VERSION)]
    last_pg, _txnid = max(metas, key=lambda meta: meta[1])  # LMDB opens the newest
    need = (last_pg + 1) * psize
    if size < need:
        raise TierIOError(
            f"LMDB catalog file {path} is truncated: {size} bytes, its newest meta page needs {need} "
            f"({last_pg + 1} pages of {psize}); restore it or delete the disk tier directory"
        )


def initial_map_bytes(num_slots: int) -> int:
    """A map size that holds ``num_slots`` entries without growing, page-rounded."""
    raw = (1 << 20) + num_slots * _ENTRY_ESTIMATE_BYTES
    return -(-raw // 4096) * 4096


class Catalog:
    """LMDB environment holding the geometry record and the block records."""

    def __init__(self, path: str, *, map_bytes: int, max_map_bytes: int, sync: bool) -> None:
        self.path = path
        self.max_map_bytes = max_map_bytes
        check_data_file(os.path.join(path, "data.mdb"))
        try:
            # lock=True: LMDB's reader table guards readers against the writer; readahead off
            # because lookups are random; meminit off because freed pages hold no secrets here.
            self.env = lmdb.open(
                path, map_size=map_bytes, subdir=True, max_dbs=2, lock=True, sync=sync,
                readahead=False, meminit=False,
            )  # fmt: skip
        except lmdb.Error as e:
            raise TierIOError(f"cannot open the LMDB catalog at {path}: {e}") from e
        self.env.reader_check()  # clear reader slots left by killed processes
        self.map_bytes = self.env.info()["map_size"]
        self.meta = self.env.open_db(b"meta")
        self.blocks = self.env.open_db(b"blocks")

    def write(self, body: Callable[[lmdb.Transaction[bytes]], _T]) -> _T:
        """Run ``body`` in one write transaction and commit; grow the map and retry when full.

        ``body`` must be safe to run again: a retried attempt sees none of the aborted one.
        """
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    return body(txn)
            except lmdb.MapFullError:
                self._grow()
            except lmdb.DiskError as e:
                raise TierFullError(f"catalog at {self.path}: no space left on device ({e})") from e
            except lmdb.Error as e:
                free = self._bytes_free()
                if free is not None and free < _COMMIT_RUN_BYTES:
                    # LMDB reports a write the filesystem cut short (it filled midway) as EIO
                    raise TierFullError(
                        f"catalog at {self.path}: no space left on device ({e}; {free} bytes free)"
                    ) from e
                raise TierIOError(f"catalog at {self.path}: transaction failed ({e})") from e

    def _bytes_free(self) -> int | None:
        """Bytes the catalog's filesystem has free for this process (None if it cannot say)."""
        try:
            stat = os.statvfs(self.path)
        except OSError:
            return None
        return stat.f_bavail * stat.f_frsize

    def _grow(self) -> None:
        new_bytes = self.map_bytes * 2
        if new_bytes > self.max_map_bytes:
            raise TierFullError(
                f"catalog at {self.path} is full at a {self.map_bytes}-byte map and may not grow "
                f"past max_map_bytes={self.max_map_bytes}"
            )
        try:
            self.env.set_mapsize(new_bytes)
        except lmdb.Error as e:
            raise TierFullError(
                f"catalog at {self.path} cannot grow from {self.map_bytes} to {new_bytes} bytes: {e}"
            ) from e
        self.map_bytes = new_bytes

    def check_geometry(
        self, payload_bytes: int, slot_bytes: int, num_slots: int, replaceable: Collection[int] = (),
        owners: Collection[str] = (),
    ) -> int:
        """Record the geometry on first use; refuse a directory made for another payload size,
        unless that size is in ``replaceable`` and every entry's layout id is in ``owners``:
        then every entry is dropped in the same transaction that records the new geometry.
        Returns the number of entries dropped."""

        def body(txn: lmdb.Transaction[bytes]) -> int:
            dropped = 0
            stored = txn.get(b"geometry", db=self.meta)
            if stored is not None:
                magic, version, old_payload, old_slot, _ = GEOMETRY.unpack(stored)
                if magic != MAGIC or version != FORMAT_VERSION:
                    raise TierError(
                        f"catalog at {self.path} has format {magic!r} v{version}; expected {MAGIC!r} v{FORMAT_VERSION}"
                    )
                if old_payload != payload_bytes and old_payload in replaceable:
                    foreign = self._foreign_layout(txn, owners)
                    if foreign is not None:
                        raise TierError(
                            f"disk tier at {os.path.dirname(self.path)} holds payload_bytes={old_payload} "
                            f"blocks of layout {foreign!r}, not this store's; use another path or delete "
                            "the directory"
                        )
                    dropped = txn.stat(self.blocks)["entries"]
                    txn.drop(self.blocks, delete=False)
                elif (old_payload, old_slot) != (payload_bytes, slot_bytes):
                    raise TierError(
                        f"disk tier at {os.path.dirname(self.path)} holds payload_bytes={old_payload} "
                        f"(slot_bytes={old_slot}) but was opened with payload_bytes={payload_bytes} "
                        f"(slot_bytes={slot_bytes}); use another path or delete the directory"
                    )
            txn.put(
                b"geometry",
                GEOMETRY.pack(MAGIC, FORMAT_VERSION, payload_bytes, slot_bytes, num_slots),
                db=self.meta,
            )
            return dropped

        try:
            return self.write(body)
        except TierError:
            raise
        except struct.error as e:
            raise TierError(f"catalog at {self.path} has an unreadable geometry record: {e}") from e

    def _foreign_layout(self, txn: lmdb.Transaction[bytes], owners: Collection[str]) -> str | None:
        """The layout id of an entry not in ``owners`` (None if every entry is theirs)."""
        for _key, value in txn.cursor(db=self.blocks):
            try:
                layout_id = decode_record(bytes(value)).layout_id
            except (TierError, UnicodeDecodeError):
                continue  # undecodable: dropped at open anyway
            if layout_id not in owners:
                return layout_id
        return None

    def scan(self, after: bytes | None, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` raw (key, value) pairs in key order, starting after key ``after``."""
        items: list[tuple[bytes, bytes]] = []
        with self.env.begin(db=self.blocks) as txn:
            cursor = txn.cursor()
            found = cursor.set_range(after) if after is not None else cursor.first()
            if found and after is not None and cursor.key() == after:
                found = cursor.next()
            while found and len(items) < limit:
                items.append((cursor.key(), cursor.value()))
                found = cursor.next()
        return items

    def iter_all(self, batch: int = 4096) -> Iterator[tuple[bytes, bytes]]:
        """Every raw (key, value) pair, read in short transactions of ``batch`` entries."""
        after: bytes | None = None
        while True:
            items = self.scan(after, batch)
            yield from items
            if len(items) < batch:
                return
            after = items[-1][0]

    def put_batch(self, items: Sequence[tuple[bytes, bytes]], stamps: dict[bytes, float]) -> list[int]:
        """Commit encoded values and pending stamps in one transaction; return replaced slots."""

        def body(txn: lmdb.Transaction[bytes]) -> list[int]:
            self._stamp(txn, stamps)
            cursor = txn.cursor(db=self.blocks)
            old_values = [cursor.replace(key, value) for key, value in items]
            return [decode_record(old).slot for old in old_values if old is not None]

        return self.write(body)

    def delete(self, keys: Sequence[bytes]) -> list[int]:
        """Delete ``keys`` (absent ones ignored) in one transaction; return their slots."""

        def body(txn: lmdb.Transaction[bytes]) -> list[int]:
            values = [txn.pop(key, db=self.blocks) for key in keys]
            return [decode_record(value).slot for value in values if value is not None]

        return self.write(body)

    def delete_at(self, pairs: Sequence[tuple[bytes, int]]) -> list[int]:
        """Delete each key whose entry still names the given slot; return the slots dropped."""

        def body(txn: lmdb.Transaction[bytes]) -> list[int]:
            dropped = []
            for key, slot in pairs:
                value = txn.get(key, db=self.blocks)
                if value is not None and decode_record(value).slot == slot:
                    txn.delete(key, db=self.blocks)
                    dropped.append(slot)
            return dropped

        return self.write(body)

    def stamp(self, stamps: dict[bytes, float]) -> None:
        """Commit last-access stamps (keys no longer cataloged are skipped)."""
        self.write(lambda txn: self._stamp(txn, stamps))

    def _stamp(self, txn: lmdb.Transaction[bytes], stamps: dict[bytes, float]) -> None:
        for key, stamp in stamps.items():
            value = txn.get(key, db=self.blocks)
            if value is not None:
                patched = bytearray(value)
                _STAMP.pack_into(patched, LAST_ACCESS_OFFSET, stamp)
                txn.put(key, bytes(patched), db=self.blocks)

    def close(self) -> None:
        """Close the environment (only ever from the process that opened it)."""
        self.env.close()
