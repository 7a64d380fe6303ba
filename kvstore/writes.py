"""The write path: ``put`` and the daemon's two-phase put (``commit`` of reserved host slots).

Blocks land in host RAM (rank 0). Making room there demotes host victims down the cascade;
tails of a put that find no evictable host slot (everything pinned or being read) go straight
to the level below. Under write-through the new blocks also reach the level below host before
the call returns. Shared levels that take puts (the remote tier with ``remote_writes="put"``)
are offered every block new to host: a copy is queued, the network is never waited for.
Every method runs with the store lock held.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvstore.cascade import Cascade
from kvstore.errors import CapacityError, KVStoreError
from kvstore.index import BlockEntry
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
        """Store rows ``src[start:stop]`` ([n, payload] uint8) under ``keys[start:stop]``.

        Raises:
            CapacityError: some blocks found no slot in any level (nothing of them is kept).
        """
        cascade = self.cascade
        index = cascade.index
        now = time.time()
        fresh: list[int] = []  # indices whose bytes must be copied into new host slots
        entries: list[BlockEntry] = []  # their entries
        refreshed: list[bytes] = []  # keys host already holds: only touched
        for i in range(start, stop):
            entry = index.get(keys[i])
            if entry is None:
                entry = index.new_entry(keys[i], keys[i - 1] if i > 0 else None, tenant, now)
                fresh.append(i)
                entries.append(entry)
            elif entry.slots[0] is None or not (entry.is_exact(0) or cascade.host.lossy):
                if entry.slots[0] is not None:  # a copy decoded from a lossy level: replaced
                    cascade.discard_copy(0, entry)
                fresh.append(i)
                entries.append(entry)
            else:
                refreshed.append(keys[i])
            cascade.note_use(entry, now)
        busy = entries + [index.entries[k] for k in refreshed]
        for entry in busy:  # in flight: making room must not evict what is being put
            entry.readers += 1
        try:
            if fresh:
                self._store_fresh(entries, fresh, src, refreshed)
            elif refreshed:
                cascade.host.policy.access(refreshed)
        finally:
            for entry in busy:
                entry.readers -= 1

    def _store_fresh(self, entries: list[BlockEntry], fresh: list[int], src: torch.Tensor,
                     refreshed: list[bytes]) -> None:
        cascade, host = self.cascade, self.cascade.host
        if host.num_free < len(fresh):
            cascade.make_room(0, len(fresh) - host.num_free)
        # Heads get host slots first; tails that find none go one level down.
        n_host = min(len(fresh), host.num_free)
        slots = host.allocate(n_host)
        rows = fresh[:n_host]
        written = True
        if rows and rows[-1] - rows[0] == n_host - 1:  # consecutive rows: no gather copy
            written = host.write(entries[:n_host], slots, src[rows[0] : rows[-1] + 1])
        elif rows:
            written = host.write(entries[:n_host], slots, src.index_select(0, torch.tensor(rows, dtype=torch.long)))
        if not written:  # only a host codec refuses, and put checked the blocks first
            host.release(slots)
            for entry in entries:
                if not entry.is_held:
                    cascade.index.discard(entry.key)
            raise KVStoreError(f"host RAM's codec could not store {n_host} blocks")
        # the rows put, for the shared levels that take puts (made only when one does)
        raw = [src[i] for i in rows] if self.takers else None
        self.publish_on_host(entries[:n_host], slots, refreshed, raw)
        overflow = entries[n_host:]
        if not overflow:
            return
        if len(cascade.levels) > 1:
            below = cascade.levels[1].rank
            pending = [(e, i) for e, i in zip(overflow, fresh[n_host:], strict=True) if e.slots[below] is None]
            cascade.store(below, [e for e, _ in pending], [src[i] for _, i in pending])
        lost = [e for e in overflow if not e.is_held]
        for entry in lost:
            cascade.index.discard(entry.key)
        if lost:
            raise CapacityError(
                f"need {len(fresh)} host slots, {n_host} free of {host.num_slots} "
                f"(the rest pinned or being read); {len(lost)} blocks found no room below either"
            )

    def publish_on_host(self, placed: list[BlockEntry], slots: Sequence[int], refreshed: list[bytes],
                        raw: Sequence[torch.Tensor] | None = None) -> None:
        """Make ``placed`` (chain order; their bytes already in host ``slots``) visible, then
        touch ``refreshed``, the keys of the same chain host already held. ``raw``: the bytes
        put, row per placed block, for the shared levels that take puts (None: host's copies,
        raw where leases and commits apply)."""
        cascade = self.cascade
        host = cascade.host
        host.counters.bytes_written += len(placed) * host.payload_bytes
        cascade.publish(0, placed, slots)
        # Touched after the insert: a found head must stay more recent than the new tail
        # behind it, or LRU would cut the prefix at its head.
        if refreshed:
            host.policy.access(refreshed)
        if self.write_through:
            on_host = [e for e in placed if e.slots[1] is None]
            payloads = host.export([e.key for e in on_host], [e.slots[0] for e in on_host])  # type: ignore[misc]
            cascade.store(1, on_host, payloads, source_rank=0)  # type: ignore[arg-type]
        takers = self.takers
        if takers and placed:
            # the bytes put: the caller's rows, or (commit) the raw host slots it wrote
            if raw is None:
                raw = host.export([e.key for e in placed], [e.slots[0] for e in placed])  # type: ignore[assignment,misc]
            for level in takers:
                level.offer([e.key for e in placed], raw)  # type: ignore[arg-type]

    def commit(self, keys: list[bytes], slots: Sequence[int], tenant: str) -> None:
        """Publish ``keys[i]`` as the bytes just written into reserved host ``slots[i]``.

        Same semantics as put: a key already in host RAM keeps its copy (the reserved slot is
        freed); under write-through the new blocks reach the level below before this returns.
        """
        cascade = self.cascade
        index = cascade.index
        now = time.time()
        placed: list[BlockEntry] = []
        placed_slots: list[int] = []
        unused: list[int] = []
        refreshed: list[bytes] = []
        for i, (key, slot) in enumerate(zip(keys, slots, strict=True)):
            entry = index.get(key)
            if entry is None:
                entry = index.new_entry(key, keys[i - 1] if i > 0 else None, tenant, now)
            cascade.note_use(entry, now)
            if entry.slots[0] is not None:
                unused.append(slot)
                refreshed.append(key)
                continue
            placed.append(entry)
            placed_slots.append(slot)
        cascade.end_reservation(len(slots), unused)
        self.publish_on_host(placed, placed_slots, refreshed)
