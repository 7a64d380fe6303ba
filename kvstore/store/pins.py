"""Pins: who holds each pin, and until when.

A pin keeps a block from eviction (``BlockEntry.pins > 0``). Every pin belongs to a pin group:
a set of blocks pinned by one call, with an optional deadline (``ttl_s``) and an optional
holder (a daemon connection's id). A group ends when its pins are undone one by one
(``unpin``), when its deadline passes (a thread wakes for the next deadline: no pin with a
TTL outlives it, whatever its client does), or at once for every group of a holder (a
closed connection: ``end_holder``). ``BlockEntry.pins`` is always the number of pins the
live groups hold on that block (``check``).

``unpin`` undoes the most recent pin of each block (of that holder, when one is named).
Forgetting a block (kvstore/store/forget.py) takes it out of every group (``drop``).

Every method but ``close`` expects the store lock held; the expiry thread takes it itself.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.store.index import BlockEntry


@dataclass
class PinGroup:
    """The pins one ``pin`` call took and still holds: per block (by ``id(entry)``), its entry
    and its pin count."""

    id: int
    holder: int | None  # a daemon connection's id; None: the embedded store's callers
    deadline: float | None  # time.monotonic() at which it ends; None: only unpin ends it
    entries: dict[int, BlockEntry] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)


class PinLedger:
    """Every live pin group of one store. Groups hold their entries, so an ``id(entry)`` key
    names one entry for as long as some group holds it."""

    def __init__(self, lock: threading.RLock) -> None:
        self._store_lock = lock
        self._groups: dict[int, PinGroup] = {}
        self._by_entry: dict[int, list[int]] = {}  # id(entry) -> ids of groups pinning it, one per pin, oldest first
        self._ids = itertools.count(1)
        self._wake = threading.Condition(threading.Lock())  # the expiry thread's, never the store's
        self._next_deadline = math.inf
        self._thread: threading.Thread | None = None
        self._closed = False
        self.num_expired = 0  # groups ended by their deadline

    def __len__(self) -> int:
        return len(self._groups)

    def pin(self, entries: Sequence[BlockEntry], ttl_s: float | None, holder: int | None) -> PinGroup:
        """Pin each of ``entries`` once, as one group (``ttl_s`` checked by ``check_ttl``)."""
        deadline = None if ttl_s is None else time.monotonic() + ttl_s
        group = PinGroup(next(self._ids), holder, deadline)
        for entry in entries:
            entry.pins += 1
            group.entries[id(entry)] = entry
            group.counts[id(entry)] = group.counts.get(id(entry), 0) + 1
            self._by_entry.setdefault(id(entry), []).append(group.id)
        if group.counts:
            self._groups[group.id] = group
        if deadline is not None and group.counts and deadline < self._next_deadline:
            self._next_deadline = deadline
            self._start_or_wake()
        return group

    def unpin(self, entries: Sequence[BlockEntry], holder: int | None) -> None:
        """Undo the most recent pin of each of ``entries`` (of ``holder``'s groups when named).
        ValueError, with nothing undone, when one has no such pin."""
        chosen: list[tuple[BlockEntry, int]] = []  # (entry, position in its _by_entry list)
        taken: dict[int, set[int]] = {}
        for entry in entries:
            ids = self._by_entry.get(id(entry), [])
            skip = taken.setdefault(id(entry), set())
            pos = next((i for i in range(len(ids) - 1, -1, -1)
                        if i not in skip and (holder is None or self._groups[ids[i]].holder == holder)), None)
            if pos is None:
                whose = "" if holder is None else " by this connection"
                raise ValueError(f"block {entry.key.hex()} is not pinned{whose}")
            skip.add(pos)
            chosen.append((entry, pos))
        for entry, pos in sorted(chosen, key=lambda c: -c[1]):  # last positions first: the others stay valid
            group_id = self._by_entry[id(entry)].pop(pos)
            self._take(self._groups[group_id], entry, 1)
        for entry, _pos in chosen:
            if not self._by_entry.get(id(entry), True):
                del self._by_entry[id(entry)]

    def _take(self, group: PinGroup, entry: BlockEntry, count: int) -> None:
        """Undo ``count`` of ``group``'s pins of ``entry`` (its ``_by_entry`` ids gone already)."""
        entry.pins -= count
        left = group.counts[id(entry)] - count
        if left:
            group.counts[id(entry)] = left
        else:
            del group.counts[id(entry)], group.entries[id(entry)]
        if not group.counts:
            self._groups.pop(group.id, None)

    def end(self, group: PinGroup) -> int:
        """End a group: its remaining pins are undone; how many."""
        if self._groups.get(group.id) is not group:
            return 0
        undone = 0
        for key_id, count in list(group.counts.items()):
            ids = self._by_entry[key_id]
            ids[:] = [i for i in ids if i != group.id]
            if not ids:
                del self._by_entry[key_id]
            self._take(group, group.entries[key_id], count)
            undone += count
        return undone

    def end_holder(self, holder: int) -> int:
        """End every group of ``holder`` (its connection closed); how many pins that undid."""
        return sum(self.end(group) for group in [le for le in self._groups.values() if le.holder == holder])

    def expire(self, now: float | None = None) -> int:
        """End the groups whose deadline passed; how many."""
        now = time.monotonic() if now is None else now
        if now < self._next_deadline:
            return 0
        dead = [group for group in self._groups.values() if group.deadline is not None and group.deadline <= now]
        for group in dead:
            self.end(group)
        self.num_expired += len(dead)
        self._next_deadline = min((le.deadline for le in self._groups.values() if le.deadline is not None),
                                  default=math.inf)
        return len(dead)

    def drop(self, entries: Sequence[BlockEntry]) -> int:
        """Take ``entries`` (being forgotten) out of every group, their pins undone; how many."""
        undone = 0
        for entry in entries:
            for group_id in set(self._by_entry.pop(id(entry), ())):
                group = self._groups[group_id]
                count = group.counts[id(entry)]
                self._take(group, entry, count)
                undone += count
        return undone

    def expires_in(self, entry: BlockEntry, now: float | None = None) -> float | None:
        """Seconds until the last pin of ``entry`` ends by itself; None when it has no pin or
        one without a deadline (0.0 once every deadline passed, before expiry ran)."""
        now = time.monotonic() if now is None else now
        deadlines = [self._groups[i].deadline for i in set(self._by_entry.get(id(entry), ()))]
        if not deadlines or None in deadlines:
            return None
        return max(0.0, max(d for d in deadlines if d is not None) - now)

    def check(self, entries: Sequence[BlockEntry]) -> None:
        """Assert each entry's pin count is what the live groups hold."""
        held: dict[int, int] = {}
        for group in self._groups.values():
            assert group.counts, f"pin group {group.id} holds nothing"
            for key_id, count in group.counts.items():
                held[key_id] = held.get(key_id, 0) + count
        assert held == {k: len(v) for k, v in self._by_entry.items()}, "pin groups and their index disagree"
        for entry in entries:
            assert entry.pins == held.get(id(entry), 0), (
                f"block {entry.key.hex()}: {entry.pins} pins, its groups hold {held.get(id(entry), 0)}")

    # ----------------------------------------------------------------------------- expiry

    def _start_or_wake(self) -> None:
        with self._wake:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="kvstore-pin-expiry", daemon=True)
                self._thread.start()
            self._wake.notify_all()

    def _run(self) -> None:
        while True:
            with self._wake:
                if self._closed:
                    return
                left = self._next_deadline - time.monotonic()
                if left > 0:
                    self._wake.wait(min(left, 60.0))
                    continue
            with self._store_lock:
                self.expire()

    def close(self) -> None:
        """Stop the expiry thread (lock free)."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(5.0)
