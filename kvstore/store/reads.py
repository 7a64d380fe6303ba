"""The read path behind get, fetch, prefetch and read leases.

Three phases:

  1. under the lock: resolve the leading run of keys and take the slot of each, mark each
     block as being read (``InFlight.start_read``: no eviction, delete or replaced copy frees
     that slot), and reserve host slots for promoting the blocks found only in lower levels;
  2. without the lock: copy host blocks into the destination, one copy per run; read each
     lower level's blocks (verified) into the reserved host slots, or straight into the
     destination when no slot could be reserved;
  3. under the lock: publish the promoted copies on host, forget blocks a level found
     corrupt, release the readers.

When every block of the run is in host RAM (the common case) and it is at most
``LOCKED_COPY_BYTES``, the copy (one per run of slots) is made in phase 1, under the lock, as
a put's is: no block is marked as being read, and there are no phases 2 and 3. The hits reach
host's eviction policy as one appended log entry (``DeferredAccess``), applied at its next
decision.

A block that fails its read ends the delivered run there: the caller recomputes the rest.

Where the indexed run ends, the shared levels (the remote tier) are asked for the blocks
that follow, in order: what they deliver lands straight in the destination and is promoted
into host RAM as new entries (``promotion`` permitting). ``extend`` does the same for a
lookup: the remote is shared and not indexed here, so only it knows what it holds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvstore.layout import raw_rows
from kvstore.results import FetchResult, PrefixMatch
from kvstore.store.cascade import Cascade
from kvstore.store.index import BlockEntry

# A host-only read up to this size copies under the store lock: marking and releasing each
# block as being read costs more than such a copy holds the lock. (A put copies under it only
# below writes.UNLOCKED_COPY_BYTES: its blocks are new, marked as being written in one pass.)
LOCKED_COPY_BYTES = 64 << 20


class ReadPath:
    def __init__(self, cascade: Cascade, *, promote: bool) -> None:
        self.cascade = cascade
        self.promote = promote
        # tenants being forgotten (kvstore/store/forget.py): their blocks a shared level delivers
        # are not promoted meanwhile (changed and read under the store lock)
        self.unpromoted: set[str] = set()

    def read_into(self, keys: Sequence[bytes], dst: torch.Tensor | None, *, count: bool = False,
                  exact: bool = False) -> FetchResult:
        """Copy the leading run of found blocks into ``dst``'s rows (CPU, contiguous: raw
        ``[n, raw block]`` uint8, or the layout's typed ``[n, *block_shape]``); with
        ``dst=None``, only promote lower-level blocks to host (a prefetch). With ``exact``, a
        block held only as a lossy copy ends the run (a miss). A block being written (a
        put's, a demotion's) is waited for."""
        try:
            return self._read_into(keys, dst, count, exact)
        finally:
            self.cascade.write_owed()  # disk writes of the demotions its promotions made room with

    def _read_into(self, keys: Sequence[bytes], dst: torch.Tensor | None, count: bool, exact: bool) -> FetchResult:
        cascade = self.cascade
        names = cascade.index.level_names
        with cascade.lock:
            cascade.inflight.wait_written(keys)
            cascade.check_open()
            entries, now = cascade.index.entries, time.time()
            # hot loop over the leading run host holds (the common case): one dict lookup and
            # a few attribute updates a block (cascade.note_use, inlined)
            host_entries: list[BlockEntry] = []
            host_slots: list[int] = []
            for key in keys:
                entry = entries.get(key)
                if entry is None:
                    break
                slot = entry.slots[0]
                if slot is None or (exact and entry.inexact & 1):
                    break
                if entry.num_uses > 1:  # seen twice already: more uses change nothing
                    entry.last_access = now
                    entry.cold = False
                else:
                    cascade.note_use(entry, now)
                host_entries.append(entry)
                host_slots.append(slot)
            num_host = len(host_entries)
            plan: list[tuple[BlockEntry, int]] = []
            if num_host < len(keys) and keys[num_host] in entries:  # lower levels hold more
                plan = [(entry, 0) for entry in host_entries]
                for key in keys[num_host:]:
                    entry = entries.get(key)
                    if entry is None:
                        break
                    found = 0 if entry.slots[0] is not None and not (exact and entry.inexact & 1) else \
                        entry.exact_rank if exact else entry.best_rank
                    if found is None:
                        break
                    cascade.note_use(entry, now)
                    plan.append((entry, found))
            host_keys = [entry.key for entry, rank in plan if rank == 0] if plan else \
                keys if num_host == len(keys) else keys[:num_host]
            if count:
                found_tiers = (names[0],) * num_host if not plan else tuple(names[r] for _, r in plan)
                cascade.lookups.count(found_tiers, len(keys), cascade.index.chain_tenant(keys))
            if host_keys:
                cascade.host.policy.access(host_keys)
            if not plan and (num_host == len(keys) or not cascade.shared) \
                    and num_host * cascade.host.payload_bytes <= LOCKED_COPY_BYTES:
                # all in host RAM (and no shared tier to ask for the rest): one copy per run
                # of slots, made under the lock, so no block needs marking as being read
                if dst is not None and num_host:
                    cascade.host.read_rows(host_slots, dst if num_host == len(dst) else dst[:num_host])
                    cascade.host.counters.bytes_read += num_host * cascade.host.payload_bytes
                return FetchResult(num_host, (names[0],) * num_host)
            if not plan:
                plan = [(entry, 0) for entry in host_entries]
            cascade.inflight.start_read(entry for entry, _rank in plan)
            # The slots to read are taken here, under the lock: a put may give a block being
            # read a new host copy meanwhile (Cascade.discard_copy); the slot taken now keeps
            # this reader's copy until its readers are done.
            slots_read: list[int] = host_slots if len(plan) == num_host else \
                [entry.slots[rank] for entry, rank in plan]  # type: ignore[misc]
            lower = [(e, r) for e, r in plan if r > 0]
            # promotions stay within their tenants' hard quotas (Cascade.promotion_room), held
            # against them until published in _finish
            promo_slots = cascade.reservations.reserve(cascade.quota.promotion_room([e for e, _ in lower])) \
                if lower and self.promote else []
            cascade.quota.claim_entries([e for e, _ in lower[: len(promo_slots)]])
        if not lower and (len(plan) == len(keys) or not cascade.shared):
            # all in host RAM, but too much to copy under the lock
            try:
                if dst is not None and plan:
                    self._copy_host(slots_read, dst)
            finally:
                with cascade.lock:
                    for entry, _rank in plan:
                        cascade.inflight.end_read(entry)
                        if entry.readers == 0 and entry.slots[0] is None:  # deleted or evicted meanwhile
                            cascade.placement.forget_if_unheld(entry)
            return FetchResult(len(plan), (names[0],) * len(plan))
        if dst is not None:
            dst = raw_rows(dst)  # lower levels read raw rows
        ok: dict[bytes, bool] = {}
        unplaced: set[bytes] = set()
        try:
            ok, unplaced = self._copy(plan, slots_read, lower, promo_slots, dst)
        finally:
            with cascade.lock:
                self._finish(plan, lower, promo_slots, ok, unplaced)
        delivered = 0
        for entry, _rank in plan:
            if not ok.get(entry.key, True):
                break
            delivered += 1
        tiers = [names[r] for _, r in plan[:delivered]]
        if delivered == len(plan) < len(keys) and cascade.shared:
            tiers += self._read_shared(keys, delivered, dst, exact)
        return FetchResult(len(tiers), tuple(tiers))

    def extend(self, keys: Sequence[bytes], match: PrefixMatch, exact: bool = False) -> PrefixMatch:
        """``match`` (the indexed run) continued through the shared levels, in order (with
        ``exact``, only lossless ones). Call without the store lock: this asks the network."""
        tiers, start = list(match.tiers), match.num_blocks
        lossy = list(match.lossy) if len(match.lossy) == start else [False] * start
        for level in self.cascade.shared:
            if start == len(keys):
                break
            if exact and level.lossy:
                continue
            n = level.leading(keys[start:])
            tiers += [level.name] * n
            lossy += [level.lossy] * n
            start += n
        return PrefixMatch(len(tiers), tuple(tiers), tuple(lossy))

    def _read_shared(self, keys: Sequence[bytes], start: int, dst: torch.Tensor | None,
                     exact: bool) -> list[str]:
        """Read ``keys[start:]`` from the shared levels into ``dst[start:]`` (or scratch rows
        for a prefetch) until one comes up short; promote the delivered run. Its tier names.
        With ``exact``, lossy levels are skipped."""
        payload = self.cascade.host.raw_bytes
        rows = dst[start:] if dst is not None else torch.empty((len(keys) - start, payload), dtype=torch.uint8)
        tiers: list[str] = []
        for level in self.cascade.shared:
            first = start + len(tiers)
            if first == len(keys):
                break
            if exact and level.lossy:
                continue
            owners: list[str | None] = [None] * (len(keys) - first)
            flags = level.read(keys[first:], list(rows[first - start :]), owners)
            n = flags.index(False) if False in flags else len(flags)
            if n and self.promote:
                self._promote(keys, first, rows[first - start : first - start + n], not level.lossy, owners[:n])
            tiers += [level.name] * n
        return tiers

    def _promote(self, keys: Sequence[bytes], first: int, rows: torch.Tensor, exact: bool,
                 tenants: Sequence[str | None]) -> None:
        """Copy ``rows`` (blocks ``keys[first:first + len(rows)]``, verified; ``exact``: the
        bytes put, not a lossy level's decoding; ``tenants``: whose each is, where the level
        said) into host slots and publish them; blocks host already holds, or that find no
        slot, are skipped, as are blocks of a tenant being forgotten."""
        try:
            self._promote_locked(keys, first, rows, exact, tenants)
        finally:
            self.cascade.write_owed()  # disk writes of the demotions it made room with, lock free

    def _promote_locked(self, keys: Sequence[bytes], first: int, rows: torch.Tensor, exact: bool,
                        tenants: Sequence[str | None]) -> None:
        cascade = self.cascade
        with cascade.lock:
            if cascade.closed:
                return
            index, now = cascade.index, time.time()
            if self.unpromoted and (None in tenants or not self.unpromoted.isdisjoint(tenants)):
                return  # a tenant being forgotten (or one the level could not name): not now
            # a block being written (a put's, a demotion's: ``writing``) is its writer's to place
            need = [i for i in range(len(rows))
                    if (e := index.get(keys[first + i])) is None or (e.slots[0] is None and not e.writing)]
            owner = next((t for t in tenants if t is not None), None)
            if owner is not None and need:  # within the tenant's hard quota in host RAM, if any
                need = need[: cascade.quota.room_for(owner, len(need), refuse=False)]
            slots = cascade.reservations.reserve(len(need))
            placed: list[BlockEntry] = []
            for i in need[: len(slots)]:
                key = keys[first + i]
                entry = index.get(key)
                if entry is None:
                    parent = keys[first + i - 1] if first + i > 0 else None
                    above = index.get(parent) if parent is not None else None
                    tenant = tenants[i] if i < len(tenants) and tenants[i] is not None else \
                        above.tenant if above is not None else ""
                    entry = index.new_entry(key, parent, tenant, now)  # type: ignore[arg-type]
                cascade.note_use(entry, now)
                placed.append(entry)
            written = cascade.host.write(placed, slots, [rows[i] for i in need[: len(slots)]])
            cascade.reservations.end(len(slots), [] if written else slots)
            if written:
                cascade.placement.publish(0, placed, slots, [exact] * len(placed))
            for entry in placed:
                cascade.placement.forget_if_unheld(entry)

    def _copy_host(self, slots: list[int], dst: torch.Tensor) -> None:
        """Copy host ``slots`` (taken under the lock) into ``dst``'s leading rows, one copy per
        run of slots."""
        host = self.cascade.host
        host.read_rows(slots, dst[: len(slots)])
        host.counters.bytes_read += len(slots) * host.payload_bytes

    def _copy(self, plan: list[tuple[BlockEntry, int]], slots_read: list[int], lower: list[tuple[BlockEntry, int]],
              promo_slots: list[int], dst: torch.Tensor | None) -> tuple[dict[bytes, bool], set[bytes]]:
        """Move the bytes of ``plan`` from ``slots_read`` (taken under the lock, one per block);
        returns per lower block whether it was read, and the keys read but not placed in their
        promotion slot."""
        cascade = self.cascade
        host = cascade.host
        ok: dict[bytes, bool] = {}
        # the dst row of each block of ``lower``, by position: a key named twice fills both rows
        rows = [i for i, (_e, r) in enumerate(plan) if r > 0]
        host_items = [(i, slots_read[i]) for i, (_e, r) in enumerate(plan) if r == 0]
        if dst is not None and host_items:
            idx, slots = zip(*host_items, strict=True)
            if list(idx) == list(range(idx[0], idx[0] + len(idx))):
                host.read_rows(slots, dst[idx[0] : idx[0] + len(idx)])
            else:
                for i, slot in host_items:
                    host.read_rows([slot], dst[i : i + 1])
            host.counters.bytes_read += len(host_items) * host.payload_bytes
        unplaced: set[bytes] = set()
        if not lower:
            return ok, unplaced
        # Each lower block goes into its reserved host slot, or straight into dst without one.
        targets_on_host = host.promotion_targets(promo_slots)
        outs: list[torch.Tensor] = list(targets_on_host)
        if dst is not None:
            outs += [dst[rows[j]] for j in range(len(promo_slots), len(lower))]
        targets = list(zip(lower[: len(outs)], outs, strict=True))
        # Raw host slots: a promoted block is copied on to dst as soon as its level has it
        # (per disk transfer, on the reader's thread, beside the transfers still in flight).
        copied: list[int] = []  # indices into promo_slots already copied to dst
        for level in cascade.levels[1:]:
            mine = [j for j, ((_e, r), _out) in enumerate(targets) if r == level.rank]
            if not mine:
                continue

            def ready(blocks: list[int], good: list[bool], mine: list[int] = mine) -> None:
                early = [(rows[mine[b]], mine[b]) for b, g in zip(blocks, good, strict=True)
                         if g and mine[b] < len(promo_slots)]
                for first, count in _runs(early):
                    row, i = early[first]
                    host.read_rows(promo_slots[i : i + count], dst[row : row + count])  # type: ignore[index]
                copied.extend(i for _row, i in early)

            keys = [targets[j][0][0].key for j in mine]
            flags = level.read(keys, [slots_read[rows[j]] for j in mine], [targets[j][1] for j in mine],
                               ready if dst is not None and host.coding is None and promo_slots else None)
            for key, good in zip(keys, flags, strict=True):
                ok[key] = good
            level.counters.bytes_read += sum(flags) * level.payload_bytes
        raw = host.raw_bytes
        read = [ok[e.key] for e, _r in lower[: len(promo_slots)]]
        promoted = host.finish_promotion(promo_slots, targets_on_host, read)
        done = set(copied)
        copies: list[tuple[int, int]] = []  # (dst row, index into promo_slots) of blocks read, not yet copied
        for i, ((entry, _r), good, placed) in enumerate(zip(lower, read, promoted, strict=False)):
            if dst is not None and good and i not in done:
                copies.append((rows[i], i))
            if good and not placed:
                unplaced.add(entry.key)
        if dst is not None and host.coding is None:  # raw slots: one copy per run of rows and slots
            for first, count in _runs(copies):
                row, i = copies[first]
                host.read_rows(promo_slots[i : i + count], dst[row : row + count])
        elif dst is not None:
            for row, i in copies:
                dst[row].copy_(targets_on_host[i][:raw])
        return ok, unplaced

    def _finish(self, plan: list[tuple[BlockEntry, int]], lower: list[tuple[BlockEntry, int]],
                promo_slots: list[int], ok: dict[bytes, bool], unplaced: set[bytes]) -> None:
        cascade = self.cascade
        promoted: list[BlockEntry] = []
        exact: list[bool] = []  # a copy decoded from a lossy level is not the bytes put
        promoted_slots: list[int] = []
        unused: list[int] = []
        seen: set[bytes] = set()  # a key named twice is settled once; its second promotion slot goes unused
        for i, (entry, rank) in enumerate(lower):
            first = entry.key not in seen
            seen.add(entry.key)
            good = ok.get(entry.key, False)
            if first and not good and entry.key in ok:
                cascade.placement.lost(rank, [entry])  # the level dropped the corrupt or unreadable slot
            elif first and good:
                cascade.levels[rank].policy.access([entry.key])
            if i < len(promo_slots):
                # (not a block being written by a put or a demotion: its writer places it)
                if first and good and entry.slots[0] is None and not entry.writing and entry.key in cascade.index \
                        and entry.key not in unplaced:
                    promoted.append(entry)
                    promoted_slots.append(promo_slots[i])
                    exact.append(entry.is_exact(rank))
                else:
                    unused.append(promo_slots[i])
        cascade.reservations.end(len(promo_slots), unused)
        cascade.quota.claim_entries([e for e, _ in lower[: len(promo_slots)]], release=True)
        if promoted:
            cascade.placement.publish(0, promoted, promoted_slots, exact)
        for entry, _rank in plan:
            cascade.inflight.end_read(entry)
            cascade.placement.forget_if_unheld(entry)


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, count)`` of each run of ``(row, index)`` pairs that both step by one."""
    runs: list[tuple[int, int]] = []
    for i, (row, index) in enumerate(pairs):
        if runs and (row, index) == (pairs[i - 1][0] + 1, pairs[i - 1][1] + 1):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
