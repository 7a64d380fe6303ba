"""Staging rows for a level that moves encoded blocks: page-aligned, reused, read in a pipeline.

A coded disk reads its encoded slots into staging rows (in place with O_DIRECT) and decodes
them into the caller's rows. Fresh staging would cost a page fault per 4 KiB on every read,
so each thread keeps its rows for the next call. A long read is split into batches read by
a few helper threads at once, and the caller decodes batch i while later batches are still
being read (the reads and the decode both release the GIL): the decode hides behind the
I/O instead of adding to it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvstore.levels.coding import aligned_rows

KEEP_BYTES = 64 << 20  # a thread keeps staging up to this size between calls
BATCH_BYTES = 2 << 20  # encoded bytes per pipelined read
READERS = 4  # reads in flight


class Staging:
    """Per-thread staging rows of ``width`` bytes, and the helper thread of pipelined reads."""

    def __init__(self, width: int) -> None:
        self.width = width
        self._local = threading.local()
        self._reader: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def rows(self, n: int) -> list[torch.Tensor]:
        """``n`` page-aligned rows of ``width`` bytes, this thread's until its next call."""
        buf: torch.Tensor | None = getattr(self._local, "buf", None)
        if buf is None or buf.shape[0] < n:
            buf = aligned_rows(n, self.width)
            if n * self.width <= KEEP_BYTES:
                self._local.buf = buf
        return list(buf[:n])

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
