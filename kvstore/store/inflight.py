"""InFlight: the one home of what runs outside the store lock: readers and writes in flight.

A block is **being read** while a copy of its bytes runs outside the lock (a get's, a
fetch's, a promotion's), while a read lease holds its host slot (the daemon's shared memory),
or while a put or a write-through is under way on it: ``BlockEntry.readers`` counts those,
and only ``start_read`` and ``end_read`` change it. A block being read is never evicted or
deleted, and the host slot a reader took is never reused before the last reader is done, even
when a put replaces that copy meanwhile: ``retire`` keeps the old slot aside (neither free nor
any block's) and the last ``end_read`` frees it.

A block is **being written** while a writer outside the lock carries it into a level
(``landing``): a big put's host copy, a write-through put's disk write, a deferred demotion.
``start_writing`` marks it (and holds it as being read), ``end_writing`` settles it and wakes
whoever waits in ``wait_written``. Meanwhile a lookup reports it in its landing level, and a
get, put, delete or pin of it waits.

                 start_read ──> readers > 0 ──> end_read (last: retired slots freed)
    start_writing ──> writing, readers > 0 ──> end_writing ──> settled.notify_all()

Every method but ``wait_*`` expects the store lock held; the ``wait_*`` methods let it go while
they wait and hold it again on return.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

from kvstore.store.index import BlockEntry, BlockIndex


class InFlight:
    """Readers and writers of one store's blocks outside its lock.

    Args:
        lock: the store lock (``settled`` is a condition on it).
        index: the store's block index (to find the entries of keys).
        free_host_slots: gives host slots back to host RAM's free list.
    """

    def __init__(self, lock: threading.RLock, index: BlockIndex, free_host_slots: Callable[[list[int]], None]
                 ) -> None:
        self.index = index
        self._free_host_slots = free_host_slots
        # notified whenever a write that ran outside the lock (a put's, a demotion's) settles
        self.settled = threading.Condition(lock)
        self.num_writing = 0  # writes under way outside the lock
        # Host slots of copies replaced while being read (see retire), by id(entry): neither
        # free nor any entry's slot, freed when the entry's last reader is done.
        self._retired: dict[int, tuple[BlockEntry, list[int]]] = {}

    # ----------------------------------------------------------------------------- readers

    def start_read(self, entries: Iterable[BlockEntry]) -> None:
        """Hold ``entries`` as being read: never evicted or deleted until ``end_read``."""
        for entry in entries:
            entry.readers += 1

    def end_read(self, entry: BlockEntry) -> None:
        """One reader of ``entry`` is done; after the last one, the host slots its replaced
        copies kept are free."""
        entry.readers -= 1
        assert entry.readers >= 0, f"block {entry.key.hex()} ended a read it never started"
        if entry.readers == 0 and self._retired:
            retired = self._retired.pop(id(entry), None)
            if retired is not None:
                self._free_host_slots(retired[1])

    def retire(self, entry: BlockEntry, host_slot: int) -> None:
        """Keep ``host_slot`` (``entry``'s replaced host copy, which some reader is copying)
        aside until ``entry``'s last reader is done."""
        assert entry.readers > 0, "only a slot being read is retired"
        self._retired.setdefault(id(entry), (entry, []))[1].append(host_slot)

    def retired_slots(self) -> list[int]:
        """Host slots kept for the readers of replaced copies (used: not free, no block's)."""
        found: list[int] = []
        for entry, slots in self._retired.values():
            assert entry.readers > 0, f"block {entry.key.hex()}: retired host slots {slots} outlive its readers"
            found += slots
        return found

    # ----------------------------------------------------------------------------- writes

    def start_writing(self, entries: Sequence[BlockEntry], landing: int) -> None:
        """``entries`` are on their way into level ``landing`` by a write outside the lock:
        held as being read, and ``writing`` until ``end_writing``."""
        for entry in entries:
            entry.writing, entry.landing = True, landing
        self.start_read(entries)
        self.num_writing += 1

    def end_writing(self, entries: Sequence[BlockEntry]) -> None:
        """The write ``start_writing`` began has settled (published, or given up): wake
        whoever waits for those blocks (once the lock is let go)."""
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

    def wait_written(self, keys: Sequence[bytes]) -> None:
        """Wait until none of ``keys`` is being written: on return, with the lock held again,
        none is. Free when nothing is being written."""
        if self.num_writing:
            self.settled.wait_for(lambda: not self.any_written(keys))

    def wait_all_written(self) -> None:
        """Wait until no write outside the lock is under way."""
        self.settled.wait_for(lambda: self.num_writing == 0)
