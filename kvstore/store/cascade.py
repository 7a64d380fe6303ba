"""Cascade: the ordered list of levels, the block index over them, and the two paths between
levels that every level goes through.

    rank 0 host RAM  --make_room-->  rank 1 disk  --make_room-->  ...  --> dropped
             ^                            |
             +------- promotion ----------+   (reservations, then publish(0, ...))

Demotion: ``make_room(r, n)`` takes up to ``n`` victims from level r's policy (never a pinned
block or one being read), stores those the level below admits and does not hold yet there
(``store``, which makes room in that level the same way), then drops them from level r. A
block no level holds any more is forgotten (and remembered as seen once, for "seen twice"
admission). Host's demotions are written below once the lock is let go: ``make_room``
stages them (a memory copy) and the thread that made room writes them (``write_owed``,
kvstore/store/demotions.py); meanwhile they are ``writing``, as a write-through put's blocks are,
and whoever needs them waits (``wait_written``). Promotion: the read path reserves host
slots, copies lower-level blocks into them outside the lock, and publishes the good copies
on host.

A block being read (``readers > 0``) is never evicted or deleted, and the slot a reader took
is never reused before its last reader is done, even when a put replaces that copy meanwhile
(``discard_copy`` retires the slot): readers and writes outside the lock are ``inflight``'s
(kvstore/store/inflight.py).

The cascade is composed of one owner per concern, each under the store lock: ``inflight``
(readers and writes outside the lock), ``reservations`` (host slots handed out ahead of their
blocks), ``quota`` (hard quotas in host RAM and the blocks claimed against them), ``lookups``
(hit and miss counting) and ``seen_once`` (the admission ghost list, kvstore/policy).

Below the indexed levels sit the shared ones (``shared``, the remote tier): asked, never
indexed (kvstore/store/levels/shared.py). Blocks that leave the last local level are offered to
the shared levels that take demotions, before their local copy is dropped.

Every method but ``write_owed`` expects the caller to hold ``lock``; the cascade owns the
index's placements (only it changes ``BlockEntry.slots``), the levels' policies and the
listeners' events.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from typing import cast

import torch

from kvstore.errors import KVStoreError
from kvstore.policy.admission import SeenOnce
from kvstore.policy.eviction import EvictionPolicy
from kvstore.store.demotions import DeferredDemotions
from kvstore.store.index import BlockEntry, BlockIndex
from kvstore.store.inflight import InFlight
from kvstore.store.levels.base import Level
from kvstore.store.levels.host_level import HostLevel
from kvstore.store.levels.shared import SharedLevel
from kvstore.store.listeners import Listeners
from kvstore.store.lookup_counts import LookupCounts
from kvstore.store.placement import Placement
from kvstore.store.quota_room import HostQuota
from kvstore.store.reservations import HostReservations


class Cascade:
    """The levels (rank 0 must be a HostLevel), the index, and the demotion/promotion paths."""

    def __init__(self, levels: list[Level], shared: Sequence[SharedLevel] = (), staging_bytes: int = 0,
                 demote_cold: bool = True) -> None:
        assert levels and isinstance(levels[0], HostLevel), "rank 0 must be host RAM"
        assert len({level.raw_bytes for level in levels}) == 1, "levels disagree on the raw block size"
        assert [level.rank for level in levels] == list(range(len(levels))), "levels out of rank order"
        self.levels = levels
        self.shared = list(shared)
        self.host = cast(HostLevel, levels[0])
        self.lock = threading.RLock()
        self.index = BlockIndex(tuple(level.name for level in levels))
        self.listeners = Listeners()
        self.inflight = InFlight(self.lock, self.index, self.host.release)
        self.reservations = HostReservations(self.host, lambda n: self.make_room(0, n))
        self.quota = HostQuota(levels, self.make_room)
        self.lookups = LookupCounts(levels)
        self.seen_once = SeenOnce()  # blocks that left the store, for "seen twice" admission
        self.placement = Placement(levels, self.index, self.listeners, self.inflight, self.seen_once)
        for level in levels:
            if level.tenants is not None:
                level.tenants.owner = self._owner_of
        self.closed = False
        self.demote_cold = demote_cold  # whether cooled blocks are written down when evicted
        # host's demotions written below after the lock is let go, up to ``staging_bytes``
        # staged at a time (kvstore/store/demotions.py); None: written at once, under the lock
        self.demotions = DeferredDemotions(self.lock, self.inflight, levels[1], staging_bytes, self._demoted) \
            if staging_bytes > 0 and len(levels) > 1 else None
        try:
            for level in levels[1:]:
                self.placement.recover(level)
        except BaseException:  # a refused directory: its lock and files are let go
            for level in reversed(levels):
                level.close()
            raise

    def check_open(self) -> None:
        if self.closed:
            raise KVStoreError("the store is closed")

    @contextlib.contextmanager
    def locked(self, blocking: bool = True) -> Iterator[bool]:
        """The store lock, held for the block; without ``blocking``, only if it is free now:
        yields whether it is held (a caller that must not wait skips its work on False)."""
        if not self.lock.acquire(blocking=blocking):
            yield False
            return
        try:
            yield True
        finally:
            self.lock.release()

    def write_owed(self) -> None:
        """(Lock free.) Write down the demotions this thread deferred while it held the lock."""
        if self.demotions is not None:
            self.demotions.write_owed()

    def _demoted(self, entries: list[BlockEntry], slots: list[int], written: bool) -> None:
        """A deferred demotion's write settled (lock held): publish it one level down, or
        forget the blocks it lost (their level counted why)."""
        if written:
            self.placement.publish_written(self.levels[1].rank, entries, slots)
        for entry in entries:
            self.placement.forget_if_unheld(entry)

    def level(self, name: str) -> Level | SharedLevel | None:
        found: list[Level | SharedLevel] = [*self.levels, *self.shared]
        return next((level for level in found if level.name == name), None)

    @property
    def level_names(self) -> tuple[str, ...]:
        """Every tier's name, fastest first: the indexed levels, then the shared ones."""
        return (*self.index.level_names, *(level.name for level in self.shared))

    # ----------------------------------------------------------------------------- entries

    def note_use(self, entry: BlockEntry, now: float | None = None) -> None:
        entry.last_access = time.time() if now is None else now
        entry.cold = False
        entry.num_uses += 1
        if entry.num_uses == 1 and entry.key in self.seen_once:
            entry.num_uses = 2  # put again after it was dropped: the second sighting

    def new_entries(self, keys: Sequence[bytes], parents: Sequence[bytes | None], tenant: str,
                    now: float) -> list[BlockEntry]:
        """Index ``keys`` (distinct, none indexed yet) as used once now: ``note_use`` of a new
        entry for each, in one pass."""
        entries = self.index.new_entries(keys, parents, tenant, now, num_uses=1)
        seen = self.seen_once
        if seen.any_of(keys):
            for entry in entries:
                if entry.key in seen:
                    entry.num_uses = 2  # put again after it was dropped: the second sighting
        return entries

    def cool(self, keys: Sequence[bytes]) -> int:
        """Make the held blocks of ``keys`` (chain order) every level's next victims, and
        written down the tiers only under ``demote_cold``: they serve only hits at boundaries
        their chain was not used at. A read or put of one warms it again. How many were held."""
        entries = [e for e in map(self.index.entries.get, keys) if e is not None and e.is_held]
        for entry in entries:
            entry.cold = True
        for level in self.levels:
            held = [e.key for e in entries if e.slots[level.rank] is not None]
            if held:
                level.policy.cool(held)
        return len(entries)

    def _owner_of(self, key: Hashable) -> str:
        return self.index.entries[key].tenant  # type: ignore[index]

    # ----------------------------------------------------------------------------- demotion

    def make_room(self, rank: int, n: int, tenant: str | None = None) -> None:
        """Evict up to ``n`` blocks from level ``rank`` (only ``tenant``'s when given: a put at
        its hard quota), demoting them to the level below (those it admits)."""
        level = self.levels[rank]
        victims = self._pop_victims(level, n, tenant)
        if not victims:
            return
        staged: list[BlockEntry] = []
        if rank + 1 < len(self.levels):
            below = self.levels[rank + 1]
            # victims come tail first; reversed, they are in chain order as store() expects
            entries = self.index.entries
            demoted = below.admit([v for v in reversed(victims)
                                   if v.slots[below.rank] is None and (self.demote_cold or not v.cold)],
                                  lambda k: entries[k].is_evictable)  # type: ignore[index]
            if demoted:
                payloads = level.export([v.key for v in demoted], [v.slots[rank] for v in demoted])  # type: ignore[misc]
                readable = [(v, p) for v, p in zip(demoted, payloads, strict=True) if p is not None]
                if rank == 0 and self.demotions is not None:
                    staged, readable = self._stage_demotions(below, readable)
                self.store(below.rank, [v for v, _ in readable], [p for _, p in readable], source_rank=rank)
        if staged:  # on their way below: not leaving the store
            taken = {id(v) for v in staged}
            self.offer_leaving(level, [v for v in victims if id(v) not in taken])
        else:
            self.offer_leaving(level, victims)
        if self.placement.drop(level, victims):
            level.counters.evictions += len(victims)
            if level.tenants is not None:
                level.tenants.note_evicted([v.tenant for v in victims])

    def _stage_demotions(self, below: Level, readable: list[tuple[BlockEntry, torch.Tensor]],
                         ) -> tuple[list[BlockEntry], list[tuple[BlockEntry, torch.Tensor]]]:
        """Defer the disk write of the leading run of host's demotions (chain order) that room
        below allows until this thread lets the lock go (kvstore/store/demotions.py). Returns the
        entries deferred and the demotions ``store`` is to write now (all of them when the
        staging budget is spent; none when there is no room below: those are dropped, as
        ``store`` drops what finds no room). A copy decoded from a lossy level never enters a
        lossless one."""
        assert self.demotions is not None
        if not below.lossy:
            readable = [(v, p) for v, p in readable if v.is_exact(0)]
        short = len(readable) - below.num_free
        if short > 0:
            self.make_room(below.rank, short)
        n = min(len(readable), below.num_free)
        if n == 0:
            return [], []
        if not self.demotions.take([v for v, _ in readable[:n]], [p for _, p in readable[:n]]):
            return [], readable[:n]
        return [v for v, _ in readable[:n]], []

    def offer_leaving(self, level: Level, entries: list[BlockEntry]) -> None:
        """Offer the blocks of ``entries`` that no other local level holds (they are about to
        leave ``level``, so they leave the store) to the shared levels that take demotions."""
        takers = [s for s in self.shared if s.takes_demotions]
        rank = level.rank
        leaving = [e for e in entries if (self.demote_cold or not e.cold)
                   and not any(slot is not None for r, slot in enumerate(e.slots) if r != rank)]
        if not takers or not leaving:
            return
        leaving.reverse()  # victims come tail first; offered in chain order
        payloads = level.export([e.key for e in leaving], [e.slots[rank] for e in leaving])  # type: ignore[misc]
        readable = [(e, p) for e, p in zip(leaving, payloads, strict=True) if p is not None]
        for shared in takers:
            # a decoded copy of a lossy level is not the bytes put: only a lossy level takes it
            admitted = {id(e) for e in shared.admit([e for e, _ in readable])}
            fit = [(e, p) for e, p in readable if (shared.lossy or e.is_exact(rank)) and id(e) in admitted]
            shared.offer([e.key for e, _ in fit], [p for _, p in fit], [e.tenant for e, _ in fit])

    def _pop_victims(self, level: Level, n: int, tenant: str | None = None) -> list[BlockEntry]:
        """Up to ``n`` entries the level's policy gives up (only ``tenant``'s when given),
        skipping pinned and in-flight blocks."""
        entries = self.index.entries
        policy: EvictionPolicy = level.policy
        tenants = level.tenant_policy() if tenant is not None else None
        victims: list[BlockEntry] = []
        while len(victims) < n:
            if tenants is None:
                key = policy.pop_victim(lambda k: entries[k].is_evictable)  # type: ignore[index]
            else:
                key = tenants.pop_victim_of(tenant, lambda k: entries[k].is_evictable)  # type: ignore[arg-type,index]
            if key is None:
                break
            victims.append(entries[key])  # type: ignore[index]
        return victims

    def store(self, rank: int, entries: list[BlockEntry], payloads: torch.Tensor | Sequence[torch.Tensor],
              source_rank: int | None = None) -> int:
        """Write ``entries`` (chain order: heads before tails) into level ``rank`` in one batch,
        making room first; publish what the level stored. Returns how many were stored.

        ``payloads`` are raw blocks: the bytes put (``source_rank`` None) or the copies of
        level ``source_rank``. A copy that is not the bytes put (decoded from a lossy level)
        never enters a lossless level below host, whose copies must stay exact across
        restarts. Blocks that find no room (everything pinned) or meet a medium failure get
        no slot there (the failure is counted); nothing half-written is ever published.
        """
        level = self.levels[rank]
        exact = [source_rank is None or e.is_exact(source_rank) for e in entries]
        if rank > 0 and not level.lossy and not all(exact):
            kept = [i for i, ok in enumerate(exact) if ok]
            entries, payloads, exact = [entries[i] for i in kept], [payloads[i] for i in kept], [True] * len(kept)
        if not entries:
            return 0
        short = len(entries) - level.num_free
        if short > 0:
            self.make_room(rank, short)
        n = min(len(entries), level.num_free)
        if n == 0:
            return 0
        entries = entries[:n]
        slots = level.allocate(n)
        if not level.write(entries, slots, payloads[:n]):
            return 0
        self.placement.publish_written(rank, entries, slots, exact[:n])
        return n

    # ----------------------------------------------------------------------------- lifecycle

    def write_back(self) -> None:
        """Before close: store what lives only in host RAM one level down, most valuable kept
        when that level is too small (host is drained in eviction order, least valuable first);
        what stays only in host RAM then is offered to the shared levels taking demotions."""
        if len(self.levels) < 2:
            self.offer_leaving(self.host, list(self.index.entries.values()))
            return
        below, entries = self.levels[1], self.index.entries
        host_only: list[BlockEntry] = []
        while (key := self.host.policy.pop_victim()) is not None:
            entry = entries[key]  # type: ignore[index]
            if entry.slots[below.rank] is None and (self.demote_cold or not entry.cold):
                host_only.append(entry)
        host_only = below.admit(host_only)
        keep = host_only[-below.num_slots :][::-1]
        payloads = self.host.export([e.key for e in keep], [e.slots[0] for e in keep])  # type: ignore[misc]
        self.store(below.rank, keep, payloads, source_rank=0)  # type: ignore[arg-type]
        self.offer_leaving(self.host, [e for e in entries.values() if e.slots[0] is not None])
