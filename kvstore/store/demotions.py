"""DeferredDemotions: host RAM's demotions written to disk once the store lock is let go.

Making room in host RAM demotes its victims one level down. Written there at once, the disk
write (payloads, sync, catalog commit: tens of milliseconds for a large batch) ran under the
store lock, and every other call of the store (another client's put, lease or get) waited for
it. Instead ``Cascade.make_room`` copies the victims' bytes into staging rows (a memory copy,
under the lock), takes their slots below and frees their host slots at once; the thread that
made room writes the copies down once it has let the lock go (``write_owed``: at the end of
its put, get or reservation) and publishes them there. That call still returns only after
the write, as before; other calls wait for it only if they need those very blocks.

Until then those blocks are in no level and marked ``writing``, landing in the level below
(as a write-through put's blocks are, landing in host RAM: kvstore/store/writes.py): a lookup
reports them there, and a get, put, delete or pin of them waits for the write to settle
(``InFlight.wait_written``). A failed write loses those demotions (the level counts the
error), as a cache may; nothing half-written is published.

Bounded: at most ``max_bytes`` of staged copies at a time, over all threads; a demotion past
that is written at once, under the lock, as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstore.store.buffer_pool import BufferPool
from kvstore.store.index import BlockEntry
from kvstore.store.inflight import InFlight
from kvstore.store.levels.base import Level
from kvstore.store.levels.coding import aligned_rows

log = logging.getLogger("kvstore.store.demotions")

# The staging budget: a sixteenth of host RAM, within these bounds.
MIN_BYTES = 8 << 20
MAX_BYTES = 256 << 20


def budget(host_bytes: int) -> int:
    """Bytes of staged demotions a store with ``host_bytes`` of host RAM holds at a time."""
    return min(MAX_BYTES, max(MIN_BYTES, host_bytes // 16))


@dataclass
class _Staged:
    entries: list[BlockEntry]  # chain order; each ``writing`` and read-held
    slots: list[int]  # their slots in the level below, taken under the lock
    staging: torch.Tensor  # the buffer holding their bytes (rows 0..n-1)


class DeferredDemotions:
    """Demotions from host into ``level`` (the level below it), staged under the store lock
    by ``take`` and written by the same thread, without the lock, in ``write_owed``.

    Args:
        lock: the store lock.
        inflight: the store's writes outside the lock (each staged demotion is one).
        level: the level below host RAM.
        max_bytes: the staging budget, over all threads.
        settle: ``settle(entries, slots, written)``, called under the lock once a staged
            write is done: publish the blocks in ``level`` (``written``) or forget them.
    """

    def __init__(self, lock: threading.RLock, inflight: InFlight, level: Level, max_bytes: int,
                 settle: Callable[[list[BlockEntry], list[int], bool], None]) -> None:
        self.lock = lock
        self.inflight = inflight
        self.settle = settle
        self.level = level
        self.max_bytes = max_bytes
        width = -(-level.raw_bytes // 4096) * 4096  # page-aligned rows: written in place with O_DIRECT
        self._width = width
        self._buffers = BufferPool(lambda n: aligned_rows(n, width), max_bytes)
        self._staged_bytes = 0  # over all threads (store lock held)
        self._owed = threading.local()  # .jobs: this thread's staged demotions, not yet written

    def take(self, entries: list[BlockEntry], payloads: list[torch.Tensor]) -> bool:
        """(Store lock held.) Stage ``entries`` (chain order; leaving host: ``payloads[i]``
        are views of their host slots, which the caller frees next) for this thread's
        ``write_owed``, taking their slots below; False (nothing done) when the staging budget
        is spent or the level below has no free slot for each. The entries stay indexed, held
        nowhere, until the write settles."""
        level, n = self.level, len(entries)
        need = n * self._width
        if not n or self._staged_bytes + need > self.max_bytes or level.num_free < n:
            return False
        staging = self._buffers.take(n)
        for row, payload in zip(staging[:n, : level.raw_bytes], payloads, strict=True):
            row.copy_(payload[: level.raw_bytes])  # a memory copy, under the lock
        slots = level.allocate(n)
        self.inflight.start_writing(entries, level.rank)  # indexed until it settles, though held nowhere
        self._staged_bytes += need
        jobs = getattr(self._owed, "jobs", None)
        if jobs is None:
            jobs = self._owed.jobs = []
        jobs.append(_Staged(entries, slots, staging))
        return True

    def write_owed(self) -> None:
        """(Store lock free.) Write the demotions this thread staged, in order, and publish
        them in the level below (or lose them, if the write fails)."""
        jobs = getattr(self._owed, "jobs", None)
        while jobs:
            self._write(jobs.pop(0))

    def _write(self, job: _Staged) -> None:
        level, n = self.level, len(job.entries)
        try:
            written = level.write(job.entries, job.slots, list(job.staging[:n, : level.raw_bytes]))
        except Exception:  # not a medium failure (those return False): those blocks are lost
            log.exception("writing %d demoted blocks to %s failed", n, level.name)
            written = False
        with self.lock:
            self._staged_bytes -= n * self._width
            self._buffers.give(job.staging)
            self.inflight.end_writing(job.entries)  # waiters wake once the lock is let go, on what follows
            self.settle(job.entries, job.slots, written)
