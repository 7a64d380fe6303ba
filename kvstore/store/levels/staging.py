"""Staging rows for a level that moves encoded blocks: page-aligned and reused.

A coded disk reads its encoded slots into staging rows (in place with O_DIRECT) and decodes
them into the caller's rows, each transfer as it arrives (kvstore/store/levels/disk_level.py).
Fresh staging would cost a page fault per 4 KiB on every read, so the level keeps a small
pool of warm buffers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from kvstore.store.buffer_pool import BufferPool
from kvstore.store.levels.coding import aligned_rows

KEEP_BYTES = 64 << 20  # staging kept between calls, in all
WARM_BYTES = 16 << 20  # staging allocated and touched when the level opens


class Staging:
    """A pool of staging rows of ``width`` bytes.

    Buffers go back to the pool after each call (up to ``KEEP_BYTES`` in all), so a store's
    reads and demotions reuse warm memory whatever thread runs them; one buffer of
    ``WARM_BYTES`` is allocated and touched up front.
    """

    def __init__(self, width: int) -> None:
        self.width = width
        self._buffers = BufferPool(lambda n: aligned_rows(n, width), KEEP_BYTES)
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


def select(items: Sequence[torch.Tensor], indices: Sequence[int]) -> list[torch.Tensor]:
    return [items[i] for i in indices]
