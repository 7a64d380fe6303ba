"""Host-slot leases: zero-copy access to host RAM for a process that maps the shared pool.

``TieredStore.host_leases``. The daemon is their only user: its shared-memory clients (which
map the pool and copy slots themselves) and its socket puts and gets (received straight into
reserved slots, sent straight from held ones). A lease is a hold on host slots, of two kinds. A read lease holds blocks like an
in-flight get (``InFlight.start_read``: never evicted, never deleted, and the slot handed out is
never reused until the release, even when a put replaces the block's host copy meanwhile:
Cascade.discard_copy); a write lease is a set of
reserved free slots that hold no block until ``commit`` publishes them, so no lookup can see
a half-written slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import overload

from kvstore.errors import KVStoreError
from kvstore.store.cascade import Cascade
from kvstore.store.index import BlockEntry
from kvstore.store.reads import ReadPath
from kvstore.store.writes import WritePath
from kvstore.tiers.records import check_name


class HostLeases:
    """The lease view of a store's cascade (every method takes the store lock itself).

    Args:
        cascade, reads, writes: the store's cascade and its read and write paths.
        check_keys: the store's check of a call's keys (``TypeError`` for a key of the wrong
            kind or length), applied to every key given here.
    """

    def __init__(self, cascade: Cascade, reads: ReadPath, writes: WritePath,
                 check_keys: Callable[[Sequence[bytes]], list[bytes]]) -> None:
        self.cascade = cascade
        self.reads = reads
        self.writes = writes
        self._check_keys = check_keys

    @property
    def shared_pool(self) -> tuple[str, int, int] | None:
        """``(path, slot_bytes, num_slots)`` of the shared host pool, or None if not shared."""
        return self.cascade.host.shared_pool

    def _check_raw(self) -> None:
        coding = self.cascade.host.coding
        if coding is not None:
            raise KVStoreError(f"host slots hold {coding.codec.name}-encoded blocks; leases hand out raw "
                               "slots and need host_codec='none'")

    def acquire(self, keys: Sequence[bytes], *, host_only: bool = False) -> list[int]:
        """Hold the leading run of ``keys`` in host RAM and return its host slot ids.

        Blocks of the run held only in lower levels are promoted first (as by get). The run
        stops at the first block that is missing or could not be brought to host. Counted
        like a get. With ``host_only``, nothing is promoted: every key is held if host RAM
        holds them all, else none is (and nothing is counted).

        Returns:
            Host slot ids of blocks ``keys[:n]``; each is held (never evicted, deleted or
            reused) until ``release(keys[:n])``.
        """
        keys = self._check_keys(keys)
        cascade = self.cascade
        self._check_raw()
        if host_only:
            return self._acquire_on_host(keys)
        with cascade.lock:
            cascade.check_open()
            match = cascade.index.match(keys)
            cascade.lookups.count(match.tiers, len(keys))
        if cascade.shared and match.num_blocks < len(keys):
            self.reads.read_into(keys, None)  # continues into the shared levels, promoting
        elif any(tier != cascade.host.name for tier in match.tiers):
            self.reads.read_into(keys[: match.num_blocks], None)
        with cascade.lock:
            cascade.check_open()
            held: list[BlockEntry] = []
            for key in keys if cascade.shared else keys[: match.num_blocks]:
                entry = cascade.index.get(key)
                if entry is None or not _readable_on_host(entry):
                    break
                held.append(entry)
            return self._hold(held)

    def _acquire_on_host(self, keys: list[bytes]) -> list[int]:
        cascade = self.cascade
        with cascade.lock:
            cascade.check_open()
            found = [cascade.index.get(key) for key in keys]
            held = [entry for entry in found if entry is not None and _readable_on_host(entry)]
            if not keys or len(held) < len(keys):
                return []
            cascade.lookups.count((cascade.host.name,) * len(keys), len(keys))
            return self._hold(held)

    def _hold(self, held: list[BlockEntry]) -> list[int]:
        """Mark host blocks as being read, counted as read (store lock held); their slots."""
        cascade, host = self.cascade, self.cascade.host
        cascade.inflight.start_read(held)
        for entry in held:
            cascade.note_use(entry)
        if held:
            host.policy.access([e.key for e in held])
        host.counters.bytes_read += len(held) * host.tier.payload_bytes
        return [e.slots[0] for e in held]  # type: ignore[misc]

    def release(self, keys: Sequence[bytes], *, blocking: bool = True) -> bool:
        """End a read lease: undo one ``acquire`` of each of ``keys``. Without ``blocking``:
        only if the store lock is free; returns whether it was done."""
        keys = self._check_keys(keys)
        cascade = self.cascade
        with cascade.locked(blocking) as held:
            if not held:
                return False
            for key in keys:
                entry = cascade.index.entries[key]
                assert entry.readers > 0, f"block {key.hex()} released but not held"
                cascade.inflight.end_read(entry)
                cascade.placement.forget_if_unheld(entry)
        return True

    @overload
    def reserve(self, n: int, evict: bool = True) -> list[int]: ...
    @overload
    def reserve(self, n: int, evict: bool = True, *, blocking: bool) -> list[int] | None: ...

    def reserve(self, n: int, evict: bool = True, *, blocking: bool = True) -> list[int] | None:
        """Take ``n`` free host slots (evicting as a put would, unless ``evict`` is False) for a
        writer outside the store. Without ``blocking``: only slots already free, and None
        (nothing taken) when fewer are free or the store lock is busy.

        Raises:
            CapacityError: fewer than ``n`` slots can be freed (the rest pinned or in flight),
                or with ``evict=False`` fewer than ``n`` are free.
        """
        self._check_raw()
        cascade = self.cascade
        try:
            with cascade.locked(blocking) as held:
                if not held:
                    return None
                cascade.check_open()
                if not blocking and cascade.host.num_free < n:
                    return None
                return cascade.reservations.reserve_exactly(n, evict and blocking)
        finally:
            cascade.write_owed()  # disk writes of the demotions it made room with, lock free

    def cancel(self, slots: Sequence[int]) -> None:
        """Give reserved slots back unpublished."""
        with self.cascade.lock:
            self.cascade.reservations.end(len(slots), slots)

    def commit(self, keys: Sequence[bytes], slots: Sequence[int], *, tenant: str = "", group: int | None = None,
               blocking: bool = True) -> bool:
        """Publish ``keys[i]`` as the bytes just written into reserved ``slots[i]`` (like put,
        ``group`` too).

        Without ``blocking`` the commit happens only if it waits on nothing (it stays in
        memory: no write-through, no shared level taking puts; the store lock is free; none of
        ``keys`` is being written); otherwise nothing is done (the slots stay reserved).
        Returns whether it was done.

        Raises:
            ValueError: a bad ``tenant`` (as for put), or not one slot per key.
            CapacityError, TierError: under write-through, as for put. On any error nothing
                is published and the slots stay reserved (give them back with ``cancel``).
        """
        check_name("tenant", tenant)
        keys = self._check_keys(keys)
        if len(keys) != len(slots):
            raise ValueError(f"{len(keys)} keys for {len(slots)} slots")
        if not blocking and (not self.writes.commits_in_memory or self.cascade.quota.capped(tenant)):
            return False  # (a hard quota may evict: demotions to write down after the lock)
        cascade = self.cascade
        try:
            with cascade.locked(blocking) as held:
                if not held or (not blocking and cascade.inflight.any_written(keys)):
                    return False
                cascade.inflight.wait_written(keys)  # another put or a demotion writing some
                cascade.check_open()
                durable = self.writes.commit(keys, slots, tenant, group)
        finally:
            cascade.write_owed()  # disk writes of the demotions its hard quota made room with
        if durable is not None:  # write-through: the disk write, outside the lock
            self.writes.finish(durable)
        return True


def _readable_on_host(entry: BlockEntry) -> bool:
    """Whether host RAM holds the block's bytes: a slot, and no put still copying into it."""
    return entry.slots[0] is not None and not entry.writing
