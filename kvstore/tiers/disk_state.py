"""The disk tier's bookkeeping: the LMDB catalog and the in-memory slot table kept in step.

Ordering rules that make a kill -9 harmless at any instant:
  * a block enters the catalog only after its payload is written and synced (``commit`` is
    called by the tier after ``Slab.write`` returned);
  * a slot becomes FREE only after the transaction that uncatalogs it commits, so no slot is
    rewritten while a committed entry still names it. A torn slot is one no entry names.

Locks: ``_catalog_lock`` serialises catalog transactions and is held across the in-memory
update that follows each commit; ``_lock`` guards the slot table, the pending stamps and the
counters, and is taken briefly (also by readers). Order: ``_catalog_lock`` before ``_lock``.
Slot I/O happens outside this class, under neither lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

from kvstore.tiers.catalog import Catalog
from kvstore.tiers.errors import TierError
from kvstore.tiers.records import Record, decode_record
from kvstore.tiers.slot_table import RESERVED, SlotTable

TOUCH_FLUSH_THRESHOLD = 1 << 16  # pending last-access stamps held before a touch commits them


class DiskState:
    """Catalog + slot table + pending last-access stamps + error counters, under two locks."""

    def __init__(self, catalog: Catalog, slots: SlotTable) -> None:
        self.catalog = catalog
        self.slots = slots
        self._stamps: dict[bytes, float] = {}  # touched since the last commit
        self._lock = threading.Lock()
        self._catalog_lock = threading.Lock()
        self.bytes_read = self.bytes_written = 0
        self.corrupt_reads = self.failed_writes = 0

    def reserve(self, count: int) -> list[int]:
        with self._lock:
            return self.slots.reserve(count)

    def release(self, slots: Sequence[int]) -> None:
        with self._lock:
            self.slots.require(slots, RESERVED, "release")
            self.slots.free(slots)

    def require_reserved(self, slots: Sequence[int]) -> None:
        with self._lock:
            self.slots.require(slots, RESERVED, "write")

    def expected(self, slots: Sequence[int]) -> list[bytes | None]:
        """Checksums to verify reads against (None where a slot holds no block)."""
        with self._lock:
            return self.slots.expected(slots)

    def fail_batch(self, slots: Sequence[int]) -> None:
        """A write batch failed before its catalog commit: its slots are free again."""
        with self._lock:
            self.slots.free(slots)
            self.failed_writes += 1

    def commit(
        self,
        keys: Sequence[bytes],
        values: Sequence[bytes],
        slots: Sequence[int],
        digests: Sequence[bytes],
        num_bytes: int,
    ) -> None:
        """Catalog a batch whose payloads are synced, with pending stamps; free replaced slots."""
        with self._catalog_lock:
            stamps = dict(self._stamps)
            try:
                replaced = self.catalog.put_batch(list(zip(keys, values, strict=True)), stamps)
            except TierError:
                self.fail_batch(slots)
                raise
            with self._lock:
                self._forget_stamps(stamps)
                self.slots.commit(slots, digests)
                self.slots.free(replaced)
                self.bytes_written += num_bytes

    def count_read(self, num_bytes: int) -> None:
        with self._lock:
            self.bytes_read += num_bytes

    def drop_corrupt(self, pairs: Sequence[tuple[bytes, int]]) -> None:
        """Uncatalog blocks that failed to read, where the catalog still maps key -> that slot."""
        with self._catalog_lock:
            try:
                dropped = self.catalog.delete_at(pairs)
            except TierError:
                dropped = []  # the entries stay: they fail verification again, never serve bytes
            with self._lock:
                self.corrupt_reads += len(pairs)
                self.slots.free([slot for slot in set(dropped) if self.slots.is_used(slot)])
                for key, _ in pairs:
                    self._stamps.pop(key, None)

    def delete(self, keys: Sequence[bytes]) -> None:
        """Uncatalog ``keys`` in one commit, then free their slots."""
        with self._catalog_lock:
            freed = self.catalog.delete(keys)
            with self._lock:
                self.slots.free(freed)
                for key in keys:
                    self._stamps.pop(key, None)

    def touch(self, keys: Sequence[bytes]) -> bool:
        """Stamp ``keys`` now; True when enough stamps are pending to commit them."""
        now = time.time()
        with self._lock:
            for key in keys:
                self._stamps[key] = now
            return len(self._stamps) >= TOUCH_FLUSH_THRESHOLD

    def flush(self) -> None:
        """Commit pending stamps."""
        with self._catalog_lock:
            stamps = dict(self._stamps)
            if stamps:
                self.catalog.stamp(stamps)
                with self._lock:
                    self._forget_stamps(stamps)

    def _forget_stamps(self, committed: dict[bytes, float]) -> None:
        """Drop committed stamps, keeping keys touched again since (caller holds ``_lock``)."""
        for key, stamp in committed.items():
            if self._stamps.get(key) == stamp:
                del self._stamps[key]

    def scan(self, batch: int = 4096) -> Iterator[tuple[bytes, Record]]:
        """Every entry in key order, pending stamps applied, read in short transactions."""
        after: bytes | None = None
        while True:
            with self._catalog_lock:
                items = self.catalog.scan(after, batch)
                with self._lock:
                    stamps = {key: self._stamps[key] for key, _ in items if key in self._stamps}
            for key, value in items:
                record = decode_record(value)
                yield key, record._replace(last_access=stamps.get(key, record.last_access))
            if len(items) < batch:
                return
            after = items[-1][0]

    def check(self) -> None:
        """Raise AssertionError unless the catalog and the slot table agree."""
        with self._catalog_lock, self._lock:
            records = ((key, decode_record(value)) for key, value in self.catalog.iter_all())
            self.slots.check((key, record.slot, record.checksum) for key, record in records)
