"""Staging rows for a level that moves encoded blocks: page-aligned, reused, read in a pipeline.

A coded disk reads its encoded slots into staging rows (in place with O_DIRECT) and decodes
them into the caller's rows. Fresh staging would cost a page fault per 4 KiB on every read,
so the level keeps a small pool of warm buffers. A long read is split into batches read by
a few helper threads at once, and the caller decodes batch i while later batches are still
being read (the reads and the decode both release the GIL): the decode hides behind the
I/O instead of adding to it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from kvstore.store.buffer_pool import BufferPool
from kvstore.store.levels.coding import aligned_rows

KEEP_BYTES = 64 << 20  # staging kept between calls, in all
WARM_BYTES = 16 << 20  # staging allocated and touched when the level opens
BATCH_BYTES = 2 << 20  # encoded bytes per pipelined read
READERS = 4  # reads in flight


class Staging:
    """A pool of staging rows of ``width`` bytes, and the helper threads of pipelined reads.

    Buffers go back to the pool after each call (up to ``KEEP_BYTES`` in all), so a store's
    reads and demotions reuse warm memory whatever thread runs them; one buffer of
    ``WARM_BYTES`` is allocated and touched up front.
    """

    def __init__(self, width: int) -> None:
        self.width = width
        self._lock = threading.Lock()
        self._buffers = BufferPool(lambda n: aligned_rows(n, width), KEEP_BYTES)
        self._reader: ThreadPoolExecutor | None = None
        warm = self._buffers.take(max(1, WARM_BYTES // width))
        warm.fill_(0)  # fault the pages in now, not during the first read
        self._buffers.give(warm)

    @contextmanager
    def rows(self, n: int) -> Iterator[list[torch.Tensor]]:
        """``n`` page-aligned rows of ``width`` bytes, the caller's until the block ends."""
        buf = self._buffers.take(n)
        try:
            yield list(buf[:n])
        finally:
            self._buffers.give(buf)

    def pipelined(self, n: int, read: Callable[[range], list[bool]],
                  decode: Callable[[range, list[bool]], None]) -> None:
        """``read(batch)`` then ``decode(batch, flags)`` over batches of ``range(n)``: the reads
        all go out at once (a few in flight, as one large read would keep the device busy) and
        each batch decodes as soon as its read is back. Returns once every read has ended; an
        exception of a read or decode propagates after that."""
        step = max(1, BATCH_BYTES // self.width)
        batches = [range(i, min(n, i + step)) for i in range(0, n, step)]
        if len(batches) <= 1:
            for batch in batches:
                decode(batch, read(batch))
            return
        reader = self._executor()
        pending: list[Future[list[bool]]] = [reader.submit(read, batch) for batch in batches]
        try:
            for batch, future in zip(batches, pending, strict=True):
                decode(batch, future.result())
        finally:
            for future in pending:  # never return while a read still writes the staging rows
                future.exception()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(READERS, thread_name_prefix="kvstore-staging")
            return self._reader

    def close(self) -> None:
        with self._lock:
            if self._reader is not None:
                self._reader.shutdown(wait=True)
                self._reader = None


def select(items: Sequence[torch.Tensor], batch: range) -> list[torch.Tensor]:
    return [items[i] for i in batch]
