"""BufferPool: staging tensors kept warm between uses.

A fresh buffer faults in each of its pages on first touch; on a hot path (a coded disk's
reads, a vLLM step's gathers) that costs more than the copies into it. A pool keeps buffers
that were given back, up to a byte budget, and hands out the smallest one with enough rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class BufferPool:
    """Buffers of ``make(n)`` (``n`` rows along dim 0), reused once given back.

    Thread-safe: a buffer may be taken on one thread and given back on another.

    Args:
        make: builds a new buffer of ``n`` rows when none kept is large enough.
        keep_bytes: the most bytes of buffers kept between uses, in all.
    """

    def __init__(self, make: Callable[[int], torch.Tensor], keep_bytes: int) -> None:
        self._make = make
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._kept: list[torch.Tensor] = []
        self._kept_bytes = 0

    def take(self, num_rows: int) -> torch.Tensor:
        """The smallest kept buffer of at least ``num_rows`` rows, else a new one of exactly
        that many; the caller uses its first ``num_rows`` rows and gives it back (``give``)
        once nothing reads or writes it any more."""
        with self._lock:
            fits = [i for i, buf in enumerate(self._kept) if buf.shape[0] >= num_rows]
            if fits:  # by position: tensors compare element-wise, so list.remove cannot find one
                buf = self._kept.pop(min(fits, key=lambda i: self._kept[i].shape[0]))
                self._kept_bytes -= buf.nbytes
                return buf
        return self._make(num_rows)

    def give(self, buf: torch.Tensor) -> None:
        """Keep ``buf`` (from ``take``) for a later use, if it fits in ``keep_bytes``."""
        with self._lock:
            if self._kept_bytes + buf.nbytes <= self.keep_bytes:
                self._kept.append(buf)
                self._kept_bytes += buf.nbytes

    def __len__(self) -> int:
        """Buffers kept now."""
        with self._lock:
            return len(self._kept)
