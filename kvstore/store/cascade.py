"""Cascade: the ordered list of levels, the block index over them, and the two paths between
levels that every level goes through.

    rank 0 host RAM  --make_room-->  rank 1 disk  --make_room-->  ...  --> dropped
             ^                            |
             +------- promotion ----------+   (reserve_host, then publish(0, ...))

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
(``discard_copy`` retires the slot; ``end_read`` frees it).

Below the indexed levels sit the shared ones (``shared``, the remote tier): asked, never
indexed (kvstore/store/levels/shared.py). Blocks that leave the last local level are offered to
the shared levels that take demotions, before their local copy is dropped.

Every method but ``write_owed`` expects the caller to hold ``lock``; the cascade owns the
index's placements, the levels' policies and the listeners' events.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterator, Sequence
from typing import cast

import torch

from kvstore.errors import CapacityError, KVStoreError, TierError
from kvstore.policy.eviction import EvictionPolicy
from kvstore.policy.quotas import QuotaTable
from kvstore.store.demotions import DeferredDemotions
from kvstore.store.index import BlockEntry, BlockIndex
from kvstore.store.levels.base import Level
from kvstore.store.levels.host_level import HostLevel
from kvstore.store.levels.shared import SharedLevel
from kvstore.store.listeners import Listeners

GHOST_KEYS = 1 << 16  # keys remembered as "seen once" for admission="seen_twice"
ROOT_KEYS = 1 << 16  # chains' first blocks remembered with their tenant, to name a lookup's tenant


class Cascade:
    """The levels (rank 0 must be a HostLevel), the index, and the demotion/promotion paths."""

    def __init__(self, levels: list[Level], shared: Sequence[SharedLevel] = (), staging_bytes: int = 0) -> None:
        assert levels and isinstance(levels[0], HostLevel), "rank 0 must be host RAM"
        assert len({level.raw_bytes for level in levels}) == 1, "levels disagree on the raw block size"
        assert [level.rank for level in levels] == list(range(len(levels))), "levels out of rank order"
        self.levels = levels
        self.shared = list(shared)
        self.host = cast(HostLevel, levels[0])
        self.lock = threading.RLock()
        # notified whenever a write that ran outside the lock (a put's, a demotion's) settles
        self.settled = threading.Condition(self.lock)
        # writes outside the lock under way: write-through puts between WritePath.put/commit
        # and WritePath.finish, and staged demotions not yet written (kvstore/store/demotions.py)
        self.num_writing = 0
        self._uncounted: deque[tuple[Sequence[str], int, str | None]] = deque()  # see count_lookup_later
        self.index = BlockIndex(tuple(level.name for level in levels))
        self.listeners = Listeners()
        self.reserved_host = 0  # host slots handed out for promotions or leases, not yet published
        # Host slots of copies replaced while being read (see discard_copy), by id(entry):
        # neither free nor any entry's slot, freed when the entry's last reader is done.
        self._retired: dict[int, tuple[BlockEntry, list[int]]] = {}
        self._seen_once: OrderedDict[bytes, None] = OrderedDict()
        # Quotas (kvstore/policy/quotas.py): the table in force; host blocks of a tenant on their way
        # into host RAM outside the lock (a write-through put's), counted against its hard quota
        self.quotas = QuotaTable()
        self.claims: dict[str, int] = {}
        self._roots: OrderedDict[bytes, str] = OrderedDict()  # first blocks of chains that left
        for level in levels:
            if level.tenants is not None:
                level.tenants.owner = self._owner_of
        self.closed = False
        # host's demotions written below after the lock is let go, up to ``staging_bytes``
        # staged at a time (kvstore/store/demotions.py); None: written at once, under the lock
        self.demotions = DeferredDemotions(self, levels[1], staging_bytes) \
            if staging_bytes > 0 and len(levels) > 1 else None
        try:
            for level in levels[1:]:
                self._recover(level)
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

    def wait_written(self, keys: Sequence[bytes]) -> None:
        """Wait (lock held; let go meanwhile) until none of ``keys`` is being written outside
        the lock (a write-through put, a deferred demotion): on return, with the lock held
        again, none is. Free when nothing is being written."""
        if self.num_writing:
            self.settled.wait_for(lambda: not self.any_written(keys))

    def start_writing(self, entries: Sequence[BlockEntry], landing: int) -> None:
        """``entries`` are on their way into level ``landing`` by a write outside the lock (a
        big put's host copy, a write-through put's, a deferred demotion's): held as being read (never evicted or
        deleted), and ``writing`` until ``end_writing``."""
        for entry in entries:
            entry.writing, entry.landing = True, landing
            entry.readers += 1
        self.num_writing += 1

    def end_writing(self, entries: Sequence[BlockEntry]) -> None:
        """The write ``start_writing`` began has settled (published, or given up): wake whoever
        waits for those blocks."""
        for entry in entries:
            entry.writing = False
            self.end_read(entry)
        self.num_writing -= 1
        self.settled.notify_all()

    def any_written(self, keys: Sequence[bytes]) -> bool:
        """Whether some of ``keys`` is being written outside the lock (``wait_written`` would wait)."""
        if not self.num_writing:
            return False
        entries = self.index.entries
        return any((e := entries.get(k)) is not None and e.writing for k in keys)

    def write_owed(self) -> None:
        """(Lock free.) Write down the demotions this thread deferred while it held the lock."""
        if self.demotions is not None:
            self.demotions.write_owed()

    def wait_all_written(self) -> None:
        """Wait (lock held; let go meanwhile) until no write outside the lock is under way."""
        self.settled.wait_for(lambda: self.num_writing == 0)

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
        entry.num_uses += 1
        if entry.num_uses == 1 and entry.key in self._seen_once:
            entry.num_uses = 2  # put again after it was dropped: the second sighting

    def new_entries(self, keys: Sequence[bytes], parents: Sequence[bytes | None], tenant: str,
                    now: float) -> list[BlockEntry]:
        """Index ``keys`` (distinct, none indexed yet) as used once now: ``note_use`` of a new
        entry for each, in one pass."""
        entries = self.index.new_entries(keys, parents, tenant, now, num_uses=1)
        seen = self._seen_once
        if seen and not seen.keys().isdisjoint(keys):
            for entry in entries:
                if entry.key in seen:
                    entry.num_uses = 2  # put again after it was dropped: the second sighting
        return entries

    def forget(self, entry: BlockEntry) -> None:
        """Drop an entry no level holds; remember it for 'seen twice' admission."""
        self.index.discard(entry.key)
        self._seen_once[entry.key] = None
        if len(self._seen_once) > GHOST_KEYS:
            self._seen_once.popitem(last=False)
        if entry.parent is None:  # a chain's first block: whose chain it was outlives it
            self._roots[entry.key] = entry.tenant
            if len(self._roots) > ROOT_KEYS:
                self._roots.popitem(last=False)

    def _owner_of(self, key: Hashable) -> str:
        return self.index.entries[key].tenant  # type: ignore[index]

    def chain_tenant(self, keys: Sequence[bytes]) -> str | None:
        """Whose chain ``keys`` is, as far as the store can tell (keys are one-way hashes):
        the tenant of its first block, held now or remembered; None for a chain never stored."""
        if not keys:
            return None
        entry = self.index.entries.get(keys[0])
        return entry.tenant if entry is not None else self._roots.get(keys[0])

    # ----------------------------------------------------------------------------- quotas

    def set_quotas(self, table: QuotaTable) -> None:
        """Put ``table`` in force: each level's policy gets its soft and hard limits in blocks
        (kvstore/policy/quotas.py); a level with no quota keeps one shared order."""
        self.quotas = table
        for level in self.levels:
            policy = level.tenant_policy()
            if policy is not None:
                policy.set_limits(*table.limits(level.name, level.num_slots, level.slot_bytes))

    def room_for(self, tenant: str, n: int, refuse: bool = True) -> int:
        """How many of ``n`` blocks new to host RAM ``tenant`` may place there under its hard
        quota: past it, the tenant's own least valuable host blocks make room first (its own
        policy's victims, demoted as any); what still does not fit (its blocks there pinned or
        being read) is refused, and counted (with ``refuse``: a put's). Its blocks on their way
        in outside the lock (``claims``) count as held. The caller marks the blocks it is
        placing, and those of the same chain host holds, as being read."""
        policy = self.host.tenant_policy()
        cap = policy.hard.get(tenant) if policy is not None else None
        if cap is None or policy is None:
            return n
        claimed = self.claims.get(tenant, 0)
        over = policy.counts.get(tenant, 0) + claimed + n - cap
        if over > 0:
            self.make_room(0, over, tenant=tenant)
            over = policy.counts.get(tenant, 0) + claimed + n - cap
        fits = max(0, min(n, n - over))
        if fits < n and refuse:
            policy.counters.row(tenant).refused += n - fits
        return fits

    def promotion_room(self, entries: Sequence[BlockEntry]) -> int:
        """How many leading ``entries`` a read may promote into host RAM within their tenants'
        hard quotas (``room_for``, no refusal counted: the rest are read without a host copy)."""
        policy = self.host.tenant_policy()
        if policy is None or not policy.hard or not entries:
            return len(entries)
        wanted: dict[str, int] = {}
        for entry in entries:
            wanted[entry.tenant] = wanted.get(entry.tenant, 0) + 1
        allowed = {t: self.room_for(t, n, refuse=False) if t in policy.hard else n for t, n in wanted.items()}
        for i, entry in enumerate(entries):
            allowed[entry.tenant] -= 1
            if allowed[entry.tenant] < 0:
                return i
        return len(entries)

    def claim_entries(self, entries: Sequence[BlockEntry], release: bool = False) -> None:
        """``claim`` (or with ``release``, ``unclaim``) one host block of each entry's tenant."""
        counts: dict[str, int] = {}
        for entry in entries:
            counts[entry.tenant] = counts.get(entry.tenant, 0) + 1
        for tenant, n in counts.items():
            (self.unclaim if release else self.claim)(tenant, n)

    def claim(self, tenant: str, n: int) -> None:
        """``n`` host blocks of ``tenant`` are on their way in outside the lock: held, for its
        hard quota, until ``unclaim``."""
        if n:
            self.claims[tenant] = self.claims.get(tenant, 0) + n

    def unclaim(self, tenant: str, n: int) -> None:
        if n:
            left = self.claims[tenant] - n
            assert left >= 0, f"tenant {tenant!r} unclaims more host blocks than it claimed"
            if left:
                self.claims[tenant] = left
            else:
                del self.claims[tenant]

    def forget_if_unheld(self, entry: BlockEntry) -> None:
        if entry.readers == 0 and not entry.is_held and self.index.entries.get(entry.key) is entry:
            self.forget(entry)

    def end_read(self, entry: BlockEntry) -> None:
        """One reader of ``entry`` (a copy outside the lock, a read lease, a put in flight) is
        done; after the last one, the host slots its replaced copies kept are free."""
        entry.readers -= 1
        if entry.readers == 0 and self._retired:
            retired = self._retired.pop(id(entry), None)
            if retired is not None:
                self.host.release(retired[1])

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
            demoted = below.admit([v for v in reversed(victims) if v.slots[below.rank] is None],
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
        if self._drop(level, victims):
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
        leaving = [e for e in entries
                   if not any(slot is not None for r, slot in enumerate(e.slots) if r != rank)]
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

    def _drop(self, level: Level, entries: list[BlockEntry]) -> bool:
        """``entries`` (victims, tail first, already out of ``level``'s policy) leave ``level``.
        False when its medium failed to let them go (a catalog that cannot commit): then
        they stay there, fully indexed and back in the policy (their bytes are intact; the
        catalog, the truth after a restart, still names them), the failure is counted, and
        no room was made."""
        rank = level.rank
        try:
            level.drop([e.key for e in entries], [e.slots[rank] for e in entries])  # type: ignore[misc]
        except TierError:
            level.counters.errors += 1
            chain = entries[::-1]
            level.policy.insert([e.key for e in chain], [e.parent for e in chain])
            return False
        for entry in entries:
            entry.slots[rank] = None
        self.listeners.removed(level.name, [e.key for e in entries])
        for entry in entries:
            self.forget_if_unheld(entry)
        return True

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
        self.publish_written(rank, entries, slots, exact[:n])
        return n

    def publish_written(self, rank: int, entries: list[BlockEntry], slots: Sequence[int],
                        exact: Sequence[bool] | None = None) -> None:
        """``publish`` what a write into level ``rank`` just stored, counted as written there."""
        level = self.levels[rank]
        level.counters.bytes_written += len(entries) * level.payload_bytes
        self.publish(rank, entries, slots, exact)

    def publish(self, rank: int, entries: list[BlockEntry], slots: Sequence[int],
                exact: Sequence[bool] | None = None) -> None:
        """Make ``entries`` (their bytes already in ``slots`` of level ``rank``) visible there.
        ``exact[i]``: the bytes written were the bytes put (default: all were); a lossy
        level's copies are never exact."""
        self.place(rank, entries, slots, exact)
        self.announce(rank, entries)

    def place(self, rank: int, entries: list[BlockEntry], slots: Sequence[int],
              exact: Sequence[bool] | None = None) -> None:
        """The first half of ``publish``: ``entries`` point at their ``slots`` of level
        ``rank`` and its policy tracks them. No reader sees them before the store lock is let
        go, so a writer may place before it writes the bytes (while the entries are still in
        the CPU caches), provided it writes, or ``unplace``s, before it lets go; then it
        ``announce``s them."""
        level = self.levels[rank]
        bit = 1 << rank
        lossy = level.lossy  # a property: read once, not per block
        for i, (entry, slot) in enumerate(zip(entries, slots, strict=True)):
            entry.slots[rank] = slot
            if lossy or (exact is not None and not exact[i]):
                entry.inexact |= bit
            else:
                entry.inexact &= ~bit
        level.policy.insert([e.key for e in entries], [e.parent for e in entries])

    def announce(self, rank: int, entries: list[BlockEntry]) -> None:
        """The second half of ``publish``: tell the listeners level ``rank`` holds ``entries``."""
        if self.listeners:
            self.listeners.stored(self.levels[rank].name, [e.key for e in entries], [e.parent for e in entries])

    def unplace(self, rank: int, entries: list[BlockEntry]) -> None:
        """Undo ``place`` (the bytes could not be written); the caller frees the slots."""
        level = self.levels[rank]
        for entry in entries:
            entry.slots[rank] = None
            level.policy.remove(entry.key)

    def discard_copy(self, rank: int, entry: BlockEntry) -> None:
        """Level ``rank`` gives up ``entry``'s copy (e.g. a decoded copy making way for the
        bytes put); the entry stays indexed even if no level holds it now.

        A host copy being read (``readers > 0``: a copy outside the lock, a read lease) keeps
        its slot: the slot is retired, neither free nor the entry's, and reused only after
        the entry's last reader is done (``end_read``). So a reader never sees its slot hold
        another block, while new readers already find the copy that replaces it."""
        level = self.levels[rank]
        slot = entry.slots[rank]
        assert slot is not None
        if rank == 0 and entry.readers:
            self._retired.setdefault(id(entry), (entry, []))[1].append(slot)
        else:
            level.drop([entry.key], [slot])
        level.policy.remove(entry.key)
        entry.slots[rank] = None
        self.listeners.removed(level.name, [entry.key])

    def lost(self, rank: int, entries: list[BlockEntry]) -> None:
        """Level ``rank`` found these blocks corrupt or unreadable and already freed their slots."""
        level = self.levels[rank]
        gone = [e for e in entries if e.slots[rank] is not None]
        for entry in gone:
            entry.slots[rank] = None
            level.policy.remove(entry.key)
        self.listeners.removed(level.name, [e.key for e in gone])

    def delete(self, entries: list[BlockEntry]) -> None:
        """Remove ``entries`` (none pinned or being read) from every level and the index."""
        for level in self.levels:
            held = [e for e in entries if e.slots[level.rank] is not None]
            if held:
                # dropped first: a medium that fails (TierError) leaves this level as it was
                level.drop([e.key for e in held], [e.slots[level.rank] for e in held])  # type: ignore[misc]
                for entry in held:
                    level.policy.remove(entry.key)
                    entry.slots[level.rank] = None
                self.listeners.removed(level.name, [e.key for e in held])
        for entry in entries:
            self.index.discard(entry.key)

    # ----------------------------------------------------------------------------- promotion

    def reserve_host(self, n: int) -> list[int]:
        """Make room for and take up to ``n`` free host slots (fewer when the rest is pinned or
        being read). They hold no block until ``publish(0, ...)``; give unused ones back with
        ``cancel_host``."""
        host = self.host
        if host.num_free < n:
            self.make_room(0, n - host.num_free)
        slots = host.allocate(min(n, host.num_free))
        self.reserved_host += len(slots)
        return slots

    def reserve_host_exactly(self, n: int, evict: bool = True) -> list[int]:
        """``reserve_host`` for a writer that needs all ``n`` slots or none; with
        ``evict=False`` only from slots already free (a reservation ahead of need).

        Raises:
            CapacityError: fewer than ``n`` slots can be freed (the rest pinned or in flight).
        """
        host = self.host
        if n > host.num_slots - self.reserved_host:  # hopeless: evict nothing
            raise CapacityError(f"need {n} host slots, {host.num_slots} in the pool, "
                                f"{self.reserved_host} of them reserved")
        if host.num_free < n and evict:
            self.make_room(0, n - host.num_free)
        if host.num_free < n:
            raise CapacityError(f"need {n} host slots, {host.num_free} free of "
                                f"{host.num_slots} (the rest pinned or being read)")
        return self.reserve_host(n)

    def end_reservation(self, num_reserved: int, unused: Sequence[int]) -> None:
        """``num_reserved`` slots from ``reserve_host`` are done with: those published hold
        blocks now, and ``unused`` (never published) go back to the free pool."""
        self.reserved_host -= num_reserved
        if unused:
            self.host.release(unused)

    # ----------------------------------------------------------------------------- queries

    def count_lookup(self, tiers: Sequence[str], num_keys: int, tenant: str | None = None) -> None:
        """Count a lookup that found the leading run ``tiers`` (each block's best tier) of
        ``num_keys``: a level hits the blocks it is the best holder of, and misses those found
        only below it plus one for a run that ends short. With ``tenant`` (``chain_tenant``),
        in that tenant's counters of each level too."""
        if self._uncounted:
            self.settle_counts()
        self._count(tiers, num_keys, tenant)

    def count_lookup_later(self, tiers: Sequence[str], num_keys: int, tenant: str | None = None) -> None:
        """``count_lookup`` for a lookup made without the lock: noted now (one atomic append),
        counted by the next holder of the lock that counts or reads the counters."""
        self._uncounted.append((tiers, num_keys, tenant))

    @property
    def num_uncounted(self) -> int:
        """Lookups noted by ``count_lookup_later`` and not counted yet."""
        return len(self._uncounted)

    def settle_counts(self) -> None:
        """Count the lookups noted by ``count_lookup_later`` (lock held)."""
        uncounted = self._uncounted
        while uncounted:
            self._count(*uncounted.popleft())

    def _count(self, tiers: Sequence[str], num_keys: int, tenant: str | None = None) -> None:
        short = 1 if len(tiers) < num_keys else 0
        below = len(tiers)
        for level in self.levels:
            hits = tiers.count(level.name)
            below -= hits
            level.counters.hits += hits
            level.counters.misses += below + short
            if tenant is not None and level.tenants is not None:
                row = level.tenants.counters.row(tenant)
                row.hits += hits
                row.misses += below + short

    def held_by_tier(self) -> dict[str, list[tuple[bytes, bytes | None]]]:
        """Per level name, ``(key, parent)`` of every block it holds."""
        held: dict[str, list[tuple[bytes, bytes | None]]] = {level.name: [] for level in self.levels}
        names = self.index.level_names
        for entry in self.index.entries.values():
            for rank, slot in enumerate(entry.slots):
                if slot is not None:
                    held[names[rank]].append((entry.key, entry.parent))
        return held

    def check_integrity(self) -> None:
        """Assert the index agrees with every level: slots, policies, pins, media (once no
        write-through put is between its halves)."""
        self.wait_all_written()
        entries = list(self.index.entries.values())
        assert self.reserved_host >= 0
        for entry in entries:
            assert entry.is_held, f"block {entry.key.hex()} indexed but in no tier"
            assert entry.pins >= 0 and entry.readers >= 0, f"block {entry.key.hex()} negative counts"
        retired: list[int] = []  # host slots of replaced copies still being read
        for entry, slots in self._retired.values():
            assert entry.readers > 0, f"block {entry.key.hex()}: retired host slots {slots} outlive its readers"
            retired += slots
        for level in self.levels:
            rank = level.rank
            held = {e.key: e.slots[rank] for e in entries if e.slots[rank] is not None}
            for entry in entries:
                assert (entry.slots[rank] is not None) == (entry.key in level.policy), (
                    f"block {entry.key.hex()}: {level.name} slot and {level.name} policy disagree"
                )
            assert len(level.policy) == len(held)
            level.policy.check_integrity()
            if rank == 0 and self.reserved_host == 0:  # reserved host slots are in neither list
                # retired slots count as used: free or another block's, a reader would see it
                self.host.check_integrity(held, retired)  # type: ignore[arg-type]
            elif rank > 0:
                level.check_integrity(held)  # type: ignore[arg-type]

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
            if entry.slots[below.rank] is None:
                host_only.append(entry)
        host_only = below.admit(host_only)
        keep = host_only[-below.num_slots :][::-1]
        payloads = self.host.export([e.key for e in keep], [e.slots[0] for e in keep])  # type: ignore[misc]
        self.store(below.rank, keep, payloads, source_rank=0)  # type: ignore[arg-type]
        self.offer_leaving(self.host, [e for e in entries.values() if e.slots[0] is not None])

    def _recover(self, level: Level) -> None:
        """Index what a persistent level kept from an earlier run: its catalog is the truth."""
        found = level.recover()
        for item in found:
            entry = self.index.get(item.key)
            if entry is None:
                entry = self.index.new_entry(item.key, None, item.tenant, item.created)
            entry.slots[level.rank] = item.slot
            if level.lossy:
                entry.inexact |= 1 << level.rank
        # newest first: the policy treats the list like a chain and evicts its end first
        level.policy.insert([d.key for d in found], [None] * len(found))
