"""The write path: ``put`` and the daemon's two-phase put (``commit`` of reserved host slots).

Blocks land in host RAM (rank 0). Making room there demotes host victims down the cascade;
tails of a put that find no evictable host slot (everything pinned or being read) go straight
to the level below. Shared levels that take puts (the remote tier with ``remote_writes="put"``)
are offered every block new to host: a copy is queued, the network is never waited for.

Write-through: the new blocks reach the level below host before any reader sees them, and a
put (or commit) that returns is durable; one whose blocks did not all reach that level raises
and leaves none of those on host. That disk write runs outside the store lock, so other
clients' gets, puts and leases do not wait behind it: ``put``/``commit`` (lock held) copy the
bytes into host slots that no reader sees yet, take the slots below, and mark the blocks
``writing`` (landing in host RAM: whoever needs them waits, ``InFlight.wait_written``) and as
being read (never evicted); they return a ``DurableWrite``, and ``finish`` (lock free) writes
it down, then publishes it in both levels under the lock, or undoes it. The caller has waited
for its keys (``wait_written``) before ``put`` or ``commit``: none is being written.

A big put copies into host RAM outside the store lock too (``HostWrite``): ``put`` (lock held)
places the blocks in their slots and marks them ``writing``; the caller copies with ``finish``
(lock free), which then announces them under the lock. Another thread's get, fetch or lease of
other blocks does not wait behind that copy; a get of these blocks waits for them, as for a
write-through put's, and a lease stops short of them (``HostLeases``).

Hard quotas (kvstore/policy/quotas.py): a put or commit whose new host blocks would take its tenant
past its hard quota in host RAM first makes room among the tenant's own host blocks
(``HostQuota.room_for``), under the same lock hold that places them; what still does not fit is
refused (tails first: a prefix is worth more than its tail), counted, and not an error. A
write-through put's blocks, placed on host only once below it, are claimed meanwhile
(``HostQuota.claim``), so concurrent puts never pass the quota by one block.

``put``, ``commit`` and ``finish_on_host`` run with the store lock held; ``finish`` takes it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.errors import CapacityError, KVStoreError
from kvstore.layout import raw_rows
from kvstore.store.cascade import Cascade
from kvstore.store.index import BlockEntry
from kvstore.store.levels.shared import SharedLevel
from kvstore.store.write_through import DurableWrite, WriteThrough

UNLOCKED_COPY_BYTES = 1 << 20  # a put's host copy this big or bigger runs outside the store lock


@dataclass
class HostWrite:
    """A put between its two halves when its copy into host RAM runs outside the store lock:
    ``placed`` (chain order) are placed in their ``slots`` but ``writing`` and read-held until
    the copy from ``src`` (their rows put) is done."""

    placed: list[BlockEntry]
    slots: list[int]
    src: torch.Tensor
    refreshed: list[bytes]  # keys of the same chain host held already: touched after the placement
    raw: list[torch.Tensor] | None  # the bytes put, for shared levels taking puts


class WritePath:
    def __init__(self, cascade: Cascade, *, write_through: bool) -> None:
        self.cascade = cascade
        self.write_through = write_through and len(cascade.levels) > 1
        self.durable = WriteThrough(cascade, self._settled_on_host)

    @property
    def takers(self) -> list[SharedLevel]:
        """The shared levels offered every block new to host."""
        return [level for level in self.cascade.shared if level.takes_puts]

    @property
    def commits_in_memory(self) -> bool:
        """A commit only publishes in host RAM: nothing written below, no copy encoded for
        a shared level (listeners are told, as always)."""
        return not self.write_through and not self.takers

    def put(self, keys: list[bytes], start: int, stop: int, src: torch.Tensor, tenant: str,
            group: int | None = None) -> DurableWrite | HostWrite | None:
        """Store blocks ``src[start:stop]`` (the layout's ``[n, *block_shape]``, contiguous,
        CPU) under ``keys[start:stop]``. Returns what ``finish`` does outside the lock: under
        write-through the disk half, for a big put the host copy (see ``HostWrite``); None when
        nothing is left. ``src`` must live until then.

        Raises:
            CapacityError: some blocks found no slot in any level (nothing of them is kept).
        """
        cascade = self.cascade
        now = time.time()
        refreshed: list[bytes] = []  # keys host already holds: only touched
        entries, fresh = self._entries_for(keys, start, stop, tenant, now, refreshed)
        if group is not None:
            for entry in entries:
                entry.group = group
        limited = bool(fresh) and cascade.quota.capped(tenant)
        if cascade.host.num_free >= len(fresh) and not self.write_through and not limited:  # nothing evicts: nothing to protect
            busy: list[BlockEntry] = []
        else:  # in flight: making room must not evict what is being put
            busy = entries + [cascade.index.entries[k] for k in refreshed]
            cascade.inflight.start_read(busy)
        try:
            if limited:
                entries, fresh = self._within_quota(entries, fresh, tenant)
            if fresh:
                return self._store_fresh(entries, fresh, src, refreshed)
            if refreshed:
                cascade.host.policy.access(refreshed)
            return None
        finally:
            for entry in busy:
                cascade.inflight.end_read(entry)

    def _within_quota(self, entries: list[BlockEntry], fresh: list[int], tenant: str
                      ) -> tuple[list[BlockEntry], list[int]]:
        """``entries``/``fresh`` (new to host, chain order) cut to what ``tenant``'s hard quota
        lets into host RAM (``HostQuota.room_for``: its own blocks make room first); the refused
        tails leave the index where no level holds them. The caller holds ``entries`` and the
        chain's blocks host has as being read (the room made must not take them)."""
        n = self.cascade.quota.room_for(tenant, len(fresh))
        if n == len(fresh):
            return entries, fresh
        for entry in entries[n:]:
            if not entry.is_held and self.cascade.index.get(entry.key) is entry:
                self.cascade.index.discard(entry.key)
        return entries[:n], fresh[:n]

    def _entries_for(self, keys: list[bytes], start: int, stop: int, tenant: str, now: float,
                     refreshed: list[bytes]) -> tuple[list[BlockEntry], list[int]]:
        """The entries of ``keys[start:stop]`` whose bytes host needs, and their indices in
        ``keys``; into ``refreshed``, the keys host already holds as put. A chain new to the
        store (the common case: an engine stores what it just computed) takes one pass."""
        span = keys[start:stop]
        index = self.cascade.index
        if index.all_new(span):
            parents = [keys[start - 1] if start > 0 else None, *span[:-1]]
            return self.cascade.new_entries(span, parents, tenant, now), list(range(start, stop))
        assert not self.cascade.inflight.any_written(span), "wait_written first"
        return self._sort_out(keys, start, stop, tenant, now, refreshed)

    def _sort_out(self, keys: list[bytes], start: int, stop: int, tenant: str, now: float,
                  refreshed: list[bytes]) -> tuple[list[BlockEntry], list[int]]:
        """``_entries_for`` block by block: keys held already, held as a lossy copy, or given
        twice."""
        cascade = self.cascade
        index = cascade.index
        fresh: list[int] = []
        entries: list[BlockEntry] = []
        taken: set[bytes] = set()
        for i in range(start, stop):
            if keys[i] in taken:  # twice in one put: equal keys are equal bytes, stored once
                continue
            taken.add(keys[i])
            entry = index.get(keys[i])
            if entry is None:
                entry = index.new_entry(keys[i], keys[i - 1] if i > 0 else None, tenant, now)
                fresh.append(i)
                entries.append(entry)
            elif entry.slots[0] is None or not (entry.is_exact(0) or cascade.host.lossy):
                if entry.slots[0] is not None:
                    # a copy decoded from a lossy level: replaced by the bytes put, in another
                    # slot; a slot being read is kept for its readers (Cascade.discard_copy)
                    cascade.placement.discard_copy(0, entry)
                fresh.append(i)
                entries.append(entry)
            else:
                refreshed.append(keys[i])
            cascade.note_use(entry, now)
        return entries, fresh

    def _store_fresh(self, entries: list[BlockEntry], fresh: list[int], src: torch.Tensor,
                     refreshed: list[bytes]) -> DurableWrite | HostWrite | None:
        cascade, host = self.cascade, self.cascade.host
        if host.num_free < len(fresh):
            cascade.make_room(0, len(fresh) - host.num_free)
        # Heads get host slots first; tails that find none go one level down.
        n_host = min(len(fresh), host.num_free)
        slots = host.allocate(n_host)
        rows = fresh[:n_host]
        placed = entries[:n_host]
        durable = self.write_through and bool(placed)
        if (not durable and n_host == len(fresh) and host.coding is None
                and n_host * host.payload_bytes >= UNLOCKED_COPY_BYTES):
            return self._begin_host_copy(placed, slots, self._rows(src, rows), refreshed)
        if not durable:
            # Placed before the copy, which evicts the entries from the CPU caches: no reader
            # sees them before the store lock is let go (see Cascade.place).
            cascade.placement.place(0, placed, slots)
        try:
            written = not rows or host.write(placed, slots, self._rows(src, rows))
        except BaseException:
            self._unstore(entries, placed, slots)
            raise
        if not written:  # only a host codec refuses, and put checked the blocks first
            self._unstore(entries, placed, slots)
            raise KVStoreError(f"host RAM's codec could not store {n_host} blocks")
        # the bytes put, for the shared levels that take puts (made only when one does)
        raw: list[torch.Tensor] | None = None
        if self.takers:
            raw_src = raw_rows(src)
            raw = [raw_src[i] for i in rows]
        pending: DurableWrite | None = None
        if durable:
            # Written down from the host slots, page-aligned, so a direct-I/O disk needs no
            # staging copy; under a host codec, from the rows put (its slots hold codes).
            if host.coding is None:
                payloads: list[torch.Tensor] = host.export([e.key for e in placed], slots)  # type: ignore[assignment]
            else:
                raw_src = raw_rows(src)
                payloads = [raw_src[i] for i in rows]
            cascade.reservations.keep(n_host)  # neither free nor any block's until finish
            try:
                pending = self.durable.begin(placed, slots, payloads, refreshed, raw, num_reserved=n_host,
                                              unused=[], own_slots=True)
            except BaseException:
                cascade.reservations.end(n_host, [])
                self._unstore(entries, placed, slots)
                raise
        else:
            self.finish_on_host(placed, refreshed, raw)
        overflow = entries[n_host:]
        if not overflow:
            return pending
        if len(cascade.levels) > 1:
            below = cascade.levels[1].rank
            pending_below = [(e, i) for e, i in zip(overflow, fresh[n_host:], strict=True) if e.slots[below] is None]
            raw_src = raw_rows(src)  # lower levels store bytes
            cascade.store(below, [e for e, _ in pending_below], [raw_src[i] for _, i in pending_below])
        lost = [e for e in overflow if not e.is_held]
        for entry in lost:
            cascade.index.discard(entry.key)
        if lost:
            error = CapacityError(
                f"need {len(fresh)} host slots, {n_host} free of {host.num_slots} "
                f"(the rest pinned or being read); {len(lost)} blocks found no room below either"
            )
            if pending is None:
                raise error
            pending.error = error  # raised once the heads' write settles
        return pending

    @staticmethod
    def _rows(src: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``src``'s rows ``rows`` (ascending): a view when they are consecutive, else a gather."""
        if rows[-1] - rows[0] == len(rows) - 1:
            return src[rows[0] : rows[-1] + 1]
        return src.index_select(0, torch.tensor(rows, dtype=torch.long))

    def _begin_host_copy(self, placed: list[BlockEntry], slots: list[int], rows: torch.Tensor,
                         refreshed: list[bytes]) -> HostWrite:
        """A ``HostWrite``'s first half (lock held): ``placed`` take their ``slots`` (placed
        now, while their entries are in the CPU caches) and are marked as being written into
        host RAM: whoever needs them waits for ``finish``, and they are never evicted."""
        cascade = self.cascade
        raw: list[torch.Tensor] | None = None
        if self.takers:  # the bytes put, for the shared levels that take puts
            raw = list(raw_rows(rows))
        cascade.placement.place(0, placed, slots)
        cascade.inflight.start_writing(placed, 0)
        return HostWrite(placed, slots, rows, refreshed, raw)

    def _finish_host_copy(self, w: HostWrite) -> None:
        """A ``HostWrite``'s second half (lock free): copy, then announce under the lock; if the
        copy raises, nothing of it is kept and the slots are free again."""
        cascade = self.cascade
        try:
            cascade.host.write(w.placed, w.slots, w.src)
        except BaseException:
            with cascade.lock:
                cascade.inflight.end_writing(w.placed)
                self._unstore(w.placed, w.placed, w.slots)
            raise
        with cascade.lock:
            cascade.inflight.end_writing(w.placed)  # waiters wake once the lock is let go, on what follows
            self.finish_on_host(w.placed, self._still_on_host(w.refreshed), w.raw)

    def _settled_on_host(self, placed: list[BlockEntry], refreshed: list[bytes],
                         raw: list[torch.Tensor] | None) -> None:
        """A write-through's blocks are below host and placed there (lock held): announce them."""
        self.finish_on_host(placed, self._still_on_host(refreshed), raw)

    def _still_on_host(self, keys: list[bytes]) -> list[bytes]:
        """Those of ``keys`` (held on host at a put's first half) that host still holds (lock held)."""
        index = self.cascade.index
        return [k for k in keys if (e := index.get(k)) is not None and e.slots[0] is not None]

    def _unstore(self, entries: list[BlockEntry], placed: list[BlockEntry], slots: list[int]) -> None:
        """A host write failed: its blocks leave host again (and the index, where no level
        holds them), and the slots are free."""
        cascade = self.cascade
        cascade.placement.unplace(0, placed)
        cascade.host.release(slots)
        for entry in entries:
            if not entry.is_held:
                cascade.index.discard(entry.key)

    def finish(self, w: DurableWrite | HostWrite) -> None:
        """The half of a put or commit that ``put``/``commit`` left for after the lock: a big
        put's host copy (``HostWrite``), or write-through's disk write (``DurableWrite``)."""
        if isinstance(w, HostWrite):
            self._finish_host_copy(w)
        else:
            self.durable.finish(w)

    def finish_on_host(self, placed: list[BlockEntry], refreshed: list[bytes],
                       raw: Sequence[torch.Tensor] | None = None) -> None:
        """Announce ``placed`` (chain order; placed in host and their bytes written, and under
        write-through already below host), then touch ``refreshed``, the keys of the same chain
        host already held. ``raw``: the bytes put, row per placed block, for the shared levels
        that take puts (None: host's copies, raw where leases and commits apply)."""
        cascade = self.cascade
        host = cascade.host
        host.counters.bytes_written += len(placed) * host.payload_bytes
        cascade.placement.announce(0, placed)
        # Touched after the insert: a found head must stay more recent than the new tail
        # behind it, or LRU would cut the prefix at its head.
        if refreshed:
            host.policy.access(refreshed)
        takers = self.takers
        if takers and placed:
            # the bytes put: the caller's rows, or (commit) the raw host slots it wrote
            if raw is None:
                raw = host.export([e.key for e in placed], [e.slots[0] for e in placed])  # type: ignore[assignment,misc]
            for level in takers:
                sent = level.admit(placed)  # remote_admission
                rows: Sequence[torch.Tensor] = raw  # type: ignore[assignment]
                if sent is not placed:
                    ids = {id(e) for e in sent}
                    rows = [rows[i] for i, e in enumerate(placed) if id(e) in ids]
                level.offer([e.key for e in sent], rows, [e.tenant for e in sent])

    def commit(self, keys: list[bytes], slots: Sequence[int], tenant: str, group: int | None = None
               ) -> DurableWrite | None:
        """Publish ``keys[i]`` as the bytes just written into reserved host ``slots[i]``.

        Same semantics as put: a key host already holds as put keeps its copy (the reserved
        slot is freed), a copy decoded from a lossy level is replaced, a key given twice is
        stored once. Under write-through, returns the disk half for ``finish``, which
        publishes the blocks once they are below host (None when no block is new to host);
        if it raises, nothing is published and every slot stays reserved: the caller cancels
        them.
        """
        cascade = self.cascade
        now = time.time()
        refreshed: list[bytes] = []
        placed, fresh = self._entries_for(keys, 0, len(keys), tenant, now, refreshed)
        if group is not None:
            for entry in placed:
                entry.group = group
        if placed and cascade.quota.capped(tenant):  # the room its hard quota makes must not take these
            busy = placed + [cascade.index.entries[k] for k in refreshed]
            cascade.inflight.start_read(busy)
            try:
                placed, fresh = self._within_quota(placed, fresh, tenant)
            finally:
                for entry in busy:
                    cascade.inflight.end_read(entry)
        if len(fresh) == len(slots):  # every slot is used (a new chain, say)
            placed_slots, unused = list(slots), []
        else:  # the slots of the blocks host holds already are given back
            placed_slots = [slots[i] for i in fresh]
            taken = set(fresh)
            unused = [slot for i, slot in enumerate(slots) if i not in taken]
        if self.write_through and placed:
            # The reserved slots hold the raw bytes written (leases need a raw host).
            payloads = cascade.host.export([e.key for e in placed], placed_slots)
            return self.durable.begin(placed, placed_slots, payloads, refreshed, None, num_reserved=len(slots),
                                       unused=unused, own_slots=False)
        cascade.reservations.end(len(slots), unused)
        cascade.placement.place(0, placed, placed_slots)
        self.finish_on_host(placed, refreshed)
        return None
