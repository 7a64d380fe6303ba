"""Disk tier: a preallocated slab of 4 KiB-aligned slots plus an LMDB catalog of what they hold.

A dumb slot store: the caller (``TieredStore``) picks keys, slots and victims; the tier moves
bytes, proves them on the way back (xxh3_128 over key || payload), and keeps the catalog that
lets the caller rebuild its index after a restart. Bookkeeping and its ordering rules live in
``kvstore.tiers.disk_state``, slot I/O in ``kvstore.tiers.slab``; the format is in docs/storage-format.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.tiers.buffers import io_views
from kvstore.tiers.checksums import Checksummer
from kvstore.tiers.disk_files import TierFiles, load_slot_table
from kvstore.tiers.disk_state import DiskState
from kvstore.tiers.errors import TierError, TierFullError, TierIOError
from kvstore.tiers.records import Record, check_keys, check_name, encode_record
from kvstore.tiers.slab import BOUNCE_BYTES, is_space_error

BlocksReady = Callable[[list[int], list[bool]], None]  # (block indices, whether each verified)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DiskEntry:
    """One catalog entry, as the store needs it to rebuild its index."""

    key: bytes
    slot: int
    tenant: str
    layout_id: str
    created: float
    last_access: float


class DiskTier:
    """Fixed-size payloads in slots of a preallocated slab file, cataloged in LMDB.

    Args:
        path: directory for the slab file and the catalog; created if missing (its parent must
            exist). One open tier per directory at a time (an exclusive flock).
        capacity_bytes: slab size, rounded down to whole slots.
        payload_bytes: bytes per block; a slot is this rounded up to 4096.
        sync: fdatasync payloads and commit the catalog durably; off survives kill -9 but not
            power loss.
        direct_io: use O_DIRECT where the filesystem allows it (attribute ``direct_io`` then
            says whether it is in use); otherwise buffered I/O plus POSIX_FADV_DONTNEED.
        map_bytes: initial LMDB map size (default: 1 MiB + 512 bytes per slot).
        max_map_bytes: the map never grows past this; the next full map is TierFullError.
        replaceable: payload sizes a directory may hold instead of ``payload_bytes`` and be
            reformatted for it (every entry dropped, counted in ``num_dropped_on_open``)
            rather than refused; the store passes its layout's sizes under other codecs.
        owners: the layout ids such a directory's entries must all have to be reformatted
            (entries of any other layout id make the open refuse, as without ``replaceable``).

    Raises:
        TierError: the path is unusable (missing parent, not a directory, not writable, open
            in another tier) or holds a slab made for another payload size.
        TierFullError: capacity is below one slot, or the filesystem cannot hold the slab.
        ValueError: ``payload_bytes`` is not a positive int.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        payload_bytes: int,
        *,
        sync: bool = True,
        direct_io: bool = True,
        map_bytes: int | None = None,
        max_map_bytes: int = 1 << 40,
        replaceable: Collection[int] = (),
        owners: Collection[str] = (),
    ) -> None:
        self._closed = True  # until everything below is open
        files = TierFiles.open(
            os.fspath(path),
            capacity_bytes,
            payload_bytes,
            sync=sync,
            direct_io=direct_io,
            map_bytes=map_bytes,
            max_map_bytes=max_map_bytes,
            replaceable=replaceable,
            owners=owners,
        )
        try:
            slots, num_dropped = load_slot_table(files)
            self.num_dropped_on_open = num_dropped + files.num_replaced
        except BaseException:
            files.close()
            raise
        self._files, self._slab, self._state = files, files.slab, DiskState(files.catalog, slots)
        self.path, self.sync, self.payload_bytes = files.path, sync, payload_bytes
        self.slot_bytes, self.num_slots = files.slab.slot_bytes, files.slab.num_slots
        self.capacity_bytes = self.num_slots * self.slot_bytes
        self.direct_io: bool = files.slab.direct_io
        self._pid = os.getpid()
        self._checksummer = Checksummer(overlap_bytes=2 * BOUNCE_BYTES)
        self._closed = False

    @property
    def num_free(self) -> int:
        """Slots neither reserved by ``allocate`` nor holding a cataloged block."""
        return self._state.slots.num_free

    @property
    def num_used(self) -> int:
        """Slots holding a cataloged block (= catalog entries)."""
        return self._state.slots.num_used

    @property
    def num_reserved(self) -> int:
        """Slots handed out by ``allocate`` and not yet written or released."""
        return self._state.slots.num_reserved

    @property
    def bytes_read(self) -> int:
        """Payload bytes delivered by verified reads."""
        return self._state.bytes_read

    @property
    def bytes_written(self) -> int:
        """Payload bytes cataloged by writes."""
        return self._state.bytes_written

    @property
    def errors(self) -> int:
        """Blocks that failed verification or I/O on read, plus write batches that failed."""
        return self._state.corrupt_reads + self._state.failed_writes

    def stats(self) -> dict[str, int | bool]:
        """Occupancy and counters (``errors`` = ``corrupt_reads`` + ``failed_writes``)."""
        names = ("num_slots", "num_free", "num_used", "num_reserved", "bytes_read", "bytes_written", "errors")
        found: dict[str, int | bool] = {name: getattr(self, name) for name in names}
        found.update(corrupt_reads=self._state.corrupt_reads, failed_writes=self._state.failed_writes)
        found["direct_io"] = self.direct_io
        return found

    def _check_usable(self) -> None:
        if self._closed:
            raise TierError(f"disk tier at {self.path} is closed")
        if os.getpid() != self._pid:
            raise TierError(
                f"disk tier at {self.path} was opened by pid {self._pid} and cannot be used from pid "
                f"{os.getpid()} (after fork); open a new DiskTier in this process"
            )

    def allocate(self, n: int) -> list[int]:
        """Reserve ``n`` free slots, contiguous when one free extent can hold them all.

        Raises:
            TierFullError: fewer than ``n`` slots are free (the message has both numbers).
        """
        self._check_usable()
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        return self._state.reserve(n)

    def release(self, slots: Sequence[int]) -> None:
        """Return reserved slots that will not be written.

        Raises:
            ValueError: a slot is out of range or not reserved (then none is released).
        """
        self._check_usable()
        self._state.release(slots)

    def write(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        payloads: Sequence[torch.Tensor | memoryview],
        tenants: Sequence[str],
        layout_id: str,
    ) -> None:
        """Store a batch: every payload written and synced, then one catalog transaction.

        A key already cataloged is overwritten; its old slot is freed once the new entry commits.
        Pending ``touch`` stamps commit in the same transaction.

        Args:
            keys: distinct block keys of 1 to 64 bytes.
            slots: distinct slots reserved by ``allocate``, one per key.
            payloads: CPU uint8 tensors or buffers of at least ``payload_bytes``; the first
                ``payload_bytes`` are stored.
            tenants: the tenant of each key.
            layout_id: the KV layout of every payload in the batch.

        Raises:
            ValueError: mismatched lengths, bad keys, names, slots or payloads; nothing written.
            TierFullError: the medium ran out of space; nothing committed, the slots are free.
            TierIOError: the medium failed; nothing committed, the slots are free.
        """
        self._check_usable()
        n = len(keys)
        if not len(slots) == len(payloads) == len(tenants) == n:
            raise ValueError(
                f"write needs one slot, payload and tenant per key: got {n} keys, {len(slots)} slots, "
                f"{len(payloads)} payloads, {len(tenants)} tenants"
            )
        check_keys(keys)
        if len(set(keys)) != n:
            raise ValueError("write got the same key twice in one batch")
        for name in (layout_id, *tenants):
            check_name("layout_id and tenants", name)
        if n == 0:
            return
        pb = self.payload_bytes
        # Zero copy only when the payload fills its slot: the padding on disk stays zeros.
        sources, in_place = io_views(
            payloads, pb, self.slot_bytes, writable=False, zero_copy=self.direct_io and pb == self.slot_bytes
        )
        self._state.require_reserved(slots)
        try:
            digests = self._checksummer.around_write(
                keys, sources, pb, lambda: self._slab.write(slots, sources, in_place, sync=self.sync)
            )
        except OSError as e:
            self._state.fail_batch(slots)
            error = TierFullError if is_space_error(e) else TierIOError
            raise error(f"writing {n} blocks ({n * pb} bytes) to {self._slab.path} failed: {e}") from e
        now = time.time()
        values = [
            encode_record(Record(slot, digest, layout_id, tenant, now, now))
            for slot, digest, tenant in zip(slots, digests, tenants, strict=True)
        ]
        self._state.commit(keys, values, slots, digests, n * pb)

    def read(
        self, keys: Sequence[bytes], slots: Sequence[int], outs: Sequence[torch.Tensor | memoryview],
        on_ready: BlocksReady | None = None,
    ) -> list[bool]:
        """Read blocks into caller memory and verify each against its catalog checksum.

        Contiguous slots move with one ``preadv`` per run: straight into an out that is
        4096-aligned and at least ``slot_bytes`` long (O_DIRECT mode), else via an aligned
        bounce buffer. Safe from several threads, concurrently with writes and deletes of
        other slots.

        Args:
            keys: the key each slot was written under.
            slots: where ``write`` put them (or ``entries()`` reports them).
            outs: CPU uint8 tensors (or writable buffers) of at least ``payload_bytes``.
            on_ready: ``on_ready(blocks, ok)`` runs on a reader thread as each transfer's blocks
                are in their outs and checked: ``blocks`` their indices into ``keys``, ``ok``
                whether each verified (so a caller can work on them while the rest of the read
                is in flight). Its exception propagates once every transfer has ended.

        Returns:
            Per block, True when ``out[:payload_bytes]`` holds the verified bytes. False when
            the slot is corrupt or unreadable (its entry is deleted and the slot freed) or holds
            no block; each False counts in ``errors``.
        """
        self._check_usable()
        n = len(keys)
        if not len(slots) == len(outs) == n:
            raise ValueError(
                f"read needs one slot and out per key: got {n} keys, {len(slots)} slots, {len(outs)} outs"
            )
        check_keys(keys)
        pb = self.payload_bytes
        dests, in_place = io_views(outs, pb, self.slot_bytes, writable=True, zero_copy=self.direct_io)
        expected = self._state.expected(slots)
        live = [i for i in range(n) if expected[i] is not None]
        live_dests = [dests[i] for i in live]
        live_ok = self._checksummer.verify_read(
            [keys[i] for i in live],
            live_dests,
            [digest for digest in expected if digest is not None],  # in the order of ``live``
            pb,
            lambda on_chunk: self._slab.read(
                [slots[i] for i in live], live_dests, [in_place[i] for i in live], on_chunk
            ),
            None if on_ready is None else lambda blocks, ok: on_ready([live[i] for i in blocks], [ok[i] for i in blocks]),
        )
        results = [False] * n
        for i, ok in zip(live, live_ok, strict=True):
            results[i] = ok
        num_good = sum(results)
        self._state.count_read(num_good * pb)
        if num_good < n:
            self._state.drop_corrupt([(keys[i], slots[i]) for i in range(n) if not results[i]])
        return results

    def delete(self, keys: Sequence[bytes]) -> None:
        """Uncatalog ``keys`` (unknown keys are ignored) and free their slots, in one commit."""
        self._check_usable()
        check_keys(keys)
        self._state.delete(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Stamp ``keys`` as accessed now; stamps commit with the next ``write`` or ``flush``."""
        self._check_usable()
        check_keys(keys)
        if self._state.touch(keys):
            self._state.flush()

    def flush(self) -> None:
        """Commit pending last-access stamps."""
        self._check_usable()
        self._state.flush()

    def entries(self) -> Iterator[DiskEntry]:
        """Every catalog entry in key order, with pending last-access stamps applied."""
        self._check_usable()
        for key, record in self._state.scan():
            yield DiskEntry(
                key, record.slot, record.tenant, record.layout_id, record.created, record.last_access
            )

    def check_integrity(self) -> None:
        """Raise AssertionError unless catalog and slot table agree.

        Catalog slots are unique, in range, used, with matching checksums; free extents are
        disjoint from them and merged; free + used + reserved slots == ``num_slots``.
        """
        self._check_usable()
        self._state.check()

    def close(self) -> None:
        """Commit pending stamps and release the files; idempotent.

        In a forked child the tier only forgets its resources: LMDB must not be touched there.
        """
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return
        try:
            self._state.flush()
        finally:
            self._checksummer.close()
            self._files.close()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
