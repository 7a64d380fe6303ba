"""The write path: ``put`` and the daemon's two-phase put (``commit`` of reserved host slots).

Blocks land in host RAM (rank 0). Making room there demotes host victims down the cascade;
tails of a put that find no evictable host slot (everything pinned or being read) go straight
to the level below. Under write-through the new blocks reach the level below host before the
store lock is let go (so before any reader sees them): a put (or commit) that returns is
durable, and one whose blocks did not all reach that level raises and leaves none of those
on host. Shared
levels that take puts (the remote tier with ``remote_writes="put"``) are offered every block
new to host: a copy is queued, the network is never waited for.
Every method runs with the store lock held.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvstore.cascade import Cascade
from kvstore.errors import CapacityError, KVStoreError, TierError
from kvstore.index import BlockEntry
from kvstore.layout import raw_rows
from kvstore.levels.shared import SharedLevel


class WritePath:
    def __init__(self, cascade: Cascade, *, write_through: bool) -> None:
        self.cascade = cascade
        self.write_through = write_through and len(cascade.levels) > 1

    @property
    def takers(self) -> list[SharedLevel]:
        """The shared levels offered every block new to host."""
        return [level for level in self.cascade.shared if level.takes_puts]

    @property
    def commits_in_memory(self) -> bool:
        """A commit only publishes in host RAM: nothing written below, no copy encoded for
        a shared level (listeners are told, as always)."""
        return not self.write_through and not self.takers

    def put(self, keys: list[bytes], start: int, stop: int, src: torch.Tensor, tenant: str) -> None:
        """Store blocks ``src[start:stop]`` (the layout's ``[n, *block_shape]``, contiguous,
        CPU) under ``keys[start:stop]``.

        Raises:
            CapacityError: some blocks found no slot in any level (nothing of them is kept),
                or (write-through) no evictable slot in the level below host.
            TierError: (write-through) the level below host failed to store them.
            Under write-through, after either error the blocks that did not reach the level
            below are in no level (nothing of them is kept); those that did stay there.
        """
        cascade = self.cascade
        now = time.time()
        refreshed: list[bytes] = []  # keys host already holds: only touched
        entries, fresh = self._entries_for(keys, start, stop, tenant, now, refreshed)
        if cascade.host.num_free >= len(fresh) and not self.write_through:  # nothing evicts: nothing to protect
            busy: list[BlockEntry] = []
        else:  # in flight: making room must not evict what is being put
            busy = entries + [cascade.index.entries[k] for k in refreshed]
            for entry in busy:
                entry.readers += 1
        try:
            if fresh:
                self._store_fresh(entries, fresh, src, refreshed)
            elif refreshed:
                cascade.host.policy.access(refreshed)
        finally:
            for entry in busy:
                cascade.end_read(entry)

    def _entries_for(self, keys: list[bytes], start: int, stop: int, tenant: str, now: float,
                     refreshed: list[bytes]) -> tuple[list[BlockEntry], list[int]]:
        """The entries of ``keys[start:stop]`` whose bytes host needs, and their indices in
        ``keys``; into ``refreshed``, the keys host already holds as put. A chain new to the
        store (the common case: an engine stores what it just computed) takes one pass."""
        span = keys[start:stop]
        if self.cascade.index.all_new(span):
            parents = [keys[start - 1] if start > 0 else None, *span[:-1]]
            return self.cascade.new_entries(span, parents, tenant, now), list(range(start, stop))
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
                    cascade.discard_copy(0, entry)
                fresh.append(i)
                entries.append(entry)
            else:
                refreshed.append(keys[i])
            cascade.note_use(entry, now)
        return entries, fresh

    def _store_fresh(self, entries: list[BlockEntry], fresh: list[int], src: torch.Tensor,
                     refreshed: list[bytes]) -> None:
        cascade, host = self.cascade, self.cascade.host
        if host.num_free < len(fresh):
            cascade.make_room(0, len(fresh) - host.num_free)
        # Heads get host slots first; tails that find none go one level down.
        n_host = min(len(fresh), host.num_free)
        slots = host.allocate(n_host)
        rows = fresh[:n_host]
        placed = entries[:n_host]
        # Placed before the copy, which evicts the entries from the CPU caches: no reader
        # sees them before the store lock is let go (see Cascade.place).
        cascade.place(0, placed, slots)
        try:
            if not rows:
                written = True
            elif rows[-1] - rows[0] == n_host - 1:  # consecutive rows: no gather copy
                written = host.write(placed, slots, src[rows[0] : rows[-1] + 1])
            else:
                written = host.write(placed, slots, src.index_select(0, torch.tensor(rows, dtype=torch.long)))
        except BaseException:
            self._unstore(entries, placed, slots)
            raise
        if not written:  # only a host codec refuses, and put checked the blocks first
            self._unstore(entries, placed, slots)
            raise KVStoreError(f"host RAM's codec could not store {n_host} blocks")
        if self.write_through and placed:
            # Durable before the lock is let go (no reader has seen the host copies yet):
            # written from the host slots, page-aligned, so a direct-I/O disk needs no
            # staging copy; under a host codec, from the rows put (its slots hold codes).
            if host.coding is None:
                payloads: Sequence[torch.Tensor | None] = host.export([e.key for e in placed], slots)
            else:
                raw_src = raw_rows(src)
                payloads = [raw_src[i] for i in rows]
            try:
                self._write_down(placed, payloads)  # type: ignore[arg-type]
            except BaseException:
                self._unstore(entries, placed, slots)
                raise
        # the bytes put, for the shared levels that take puts (made only when one does)
        raw: list[torch.Tensor] | None = None
        if self.takers:
            raw_src = raw_rows(src)
            raw = [raw_src[i] for i in rows]
        self.finish_on_host(placed, refreshed, raw)
        overflow = entries[n_host:]
        if not overflow:
            return
        if len(cascade.levels) > 1:
            below = cascade.levels[1].rank
            pending = [(e, i) for e, i in zip(overflow, fresh[n_host:], strict=True) if e.slots[below] is None]
            raw_src = raw_rows(src)  # lower levels store bytes
            cascade.store(below, [e for e, _ in pending], [raw_src[i] for _, i in pending])
        lost = [e for e in overflow if not e.is_held]
        for entry in lost:
            cascade.index.discard(entry.key)
        if lost:
            raise CapacityError(
                f"need {len(fresh)} host slots, {n_host} free of {host.num_slots} "
                f"(the rest pinned or being read); {len(lost)} blocks found no room below either"
            )

    def _unstore(self, entries: list[BlockEntry], placed: list[BlockEntry], slots: list[int]) -> None:
        """A host write failed: its blocks leave host again (and the index, where no level
        holds them), and the slots are free."""
        cascade = self.cascade
        cascade.unplace(0, placed)
        cascade.host.release(slots)
        for entry in entries:
            if not entry.is_held:
                cascade.index.discard(entry.key)

    def _write_down(self, entries: list[BlockEntry], payloads: Sequence[torch.Tensor]) -> None:
        """Write-through: store ``entries`` (chain order; ``payloads[i]``, the bytes put) in
        the level below host, where it does not hold them yet, before any reader sees them.

        Raises:
            TierError: the level below failed to store them (its medium's error, with the
                numbers), or CapacityError: it has no evictable slot for them (the rest pinned
                or being read). Either way the put is not acknowledged, and the blocks that
                did not reach the level below leave the index where no level holds them (the
                caller places nothing on host then).
        """
        cascade = self.cascade
        below = cascade.levels[1]
        todo = [(e, p) for e, p in zip(entries, payloads, strict=True) if e.slots[below.rank] is None]
        if not todo:
            return
        num_errors = below.counters.errors
        stored = cascade.store(below.rank, [e for e, _ in todo], [p for _, p in todo])
        if stored == len(todo):
            return
        missing = [e for e, _ in todo[stored:]]  # store() keeps the heads it has room for
        for entry in missing:
            if not entry.is_held and cascade.index.get(entry.key) is entry:
                cascade.index.discard(entry.key)
        what = (f"put not acknowledged under write-through: {len(missing)} of {len(entries)} blocks "
                f"did not reach {below.name}")
        # A level that records its medium's last failure (the disk) names it.
        cause = getattr(below, "last_error", None) if below.counters.errors > num_errors else None
        if isinstance(cause, TierError):
            raise type(cause)(f"{what}: {cause}") from cause
        raise CapacityError(f"{what}: need {len(missing)} {below.name} slots, {below.num_free} free of "
                            f"{below.num_slots} (the rest pinned or being read)")

    def finish_on_host(self, placed: list[BlockEntry], refreshed: list[bytes],
                       raw: Sequence[torch.Tensor] | None = None) -> None:
        """Announce ``placed`` (chain order; placed in host and their bytes written, and under
        write-through already below host), then touch ``refreshed``, the keys of the same chain
        host already held. ``raw``: the bytes put, row per placed block, for the shared levels
        that take puts (None: host's copies, raw where leases and commits apply)."""
        cascade = self.cascade
        host = cascade.host
        host.counters.bytes_written += len(placed) * host.payload_bytes
        cascade.announce(0, placed)
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
                level.offer([e.key for e in placed], raw)  # type: ignore[arg-type]

    def commit(self, keys: list[bytes], slots: Sequence[int], tenant: str) -> None:
        """Publish ``keys[i]`` as the bytes just written into reserved host ``slots[i]``.

        Same semantics as put: a key host already holds as put keeps its copy (the reserved
        slot is freed), a copy decoded from a lossy level is replaced, a key given twice is
        stored once; under write-through the new blocks reach the level below before this
        returns.

        Raises:
            TierError, CapacityError: (write-through) as put's. Nothing is published then and
                every slot stays reserved: the caller cancels them.
        """
        cascade = self.cascade
        now = time.time()
        refreshed: list[bytes] = []
        placed, fresh = self._entries_for(keys, 0, len(keys), tenant, now, refreshed)
        if len(fresh) == len(slots):  # every slot is used (a new chain, say)
            placed_slots, unused = list(slots), []
        else:  # the slots of the blocks host holds already are given back
            placed_slots = [slots[i] for i in fresh]
            taken = set(fresh)
            unused = [slot for i, slot in enumerate(slots) if i not in taken]
        if self.write_through and placed:
            # Durable before visible, and before the reservation ends. The reserved slots hold
            # the raw bytes written (leases need a raw host); making room below must not
            # evict what is being committed.
            payloads = cascade.host.export([e.key for e in placed], placed_slots)
            for entry in placed:
                entry.readers += 1
            try:
                self._write_down(placed, payloads)  # type: ignore[arg-type]
            finally:
                for entry in placed:
                    cascade.end_read(entry)
        cascade.end_reservation(len(slots), unused)
        cascade.place(0, placed, placed_slots)
        self.finish_on_host(placed, refreshed)
