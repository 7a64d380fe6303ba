"""Large memory copies shared among a few threads, one chunk at a time.

torch's ``copy_`` cuts a copy into one equal share per OpenMP thread up front, and its threads
spin for a while after the copy ends. Beside another busy process on few cores (the daemon,
publishing the put before this one) that costs twice: the share whose core the other process
takes finishes late, and the whole copy waits for it; then the spinning threads keep a core
the other process wants. Here every thread takes the next chunk once its last is done, so a
thread slowed by a neighbour takes fewer, and the helpers sleep as soon as the copy is over.
Alone on the machine it moves bytes as fast as ``copy_`` (``ctypes.memmove`` lets go of the
GIL while it copies).

A ``Copier`` is used from any number of threads at once; each ``copy`` waits for its own chunks.
A process forked from one whose copier had started its helpers starts its own.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

CHUNK = 1 << 20  # bytes per turn: measured best of 256 KiB - 2 MiB on 12 MiB copies
MIN_BYTES = 4 << 20  # smaller copies run in the caller (a hand-off to a helper and back: ~90 us here)
MAX_THREADS = 4  # a cautious cap (each chunk is handed out under the GIL); only 2 cores were measured

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination, source)


class Copier:
    """Copy pairs of tensors with ``threads`` threads (the caller's and ``threads - 1`` helpers).

    Pairs that are not both contiguous CPU tensors of one dtype and size (a strided view, a
    conversion) are left to ``copy_``, in the caller.
    """

    def __init__(self, threads: int | None = None) -> None:
        if threads is None:
            threads = min(torch.get_num_threads(), MAX_THREADS)
        if threads < 1:
            raise ValueError(f"a copier needs one thread or more, got {threads}")
        self.threads = threads
        self._helpers: ThreadPoolExecutor | None = None
        self._pid = 0  # the process the helpers were started in (a forked child has none of them)
        self._lock = threading.Lock()  # two first copies at once start one set of helpers

    def copy(self, pairs: Sequence[Pair]) -> None:
        """``dst.copy_(src)`` for every ``(dst, src)`` in ``pairs``; returns once all are done."""
        chunks: list[tuple[int, int, int]] = []
        total = 0
        for dst, src in pairs:
            if not _flat_pair(dst, src):
                dst.copy_(src)
                continue
            d, s, n = dst.data_ptr(), src.data_ptr(), src.nbytes
            chunks += [(d + at, s + at, min(CHUNK, n - at)) for at in range(0, n, CHUNK)]
            total += n
        if self.threads == 1 or total < MIN_BYTES:
            for chunk in chunks:
                ctypes.memmove(*chunk)
            return
        with self._lock:
            if self._helpers is None or self._pid != os.getpid():
                self._helpers = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvstore-copy")
                self._pid = os.getpid()
            helpers = self._helpers
        turns = itertools.count()  # next() on it is atomic: each chunk goes to one thread
        helping = [helpers.submit(_take_turns, chunks, turns) for _ in range(self.threads - 1)]
        try:
            _take_turns(chunks, turns)
        finally:
            for future in helping:  # the tensors must outlive every chunk's copy
                future.result()

    def close(self) -> None:
        """Stop the helper threads (a later copy starts them again)."""
        with self._lock:
            helpers, self._helpers = self._helpers, None
        if helpers is not None:
            helpers.shutdown(wait=True)


def _take_turns(chunks: list[tuple[int, int, int]], turns: itertools.count[int]) -> None:
    num_chunks = len(chunks)
    memmove = ctypes.memmove
    while (i := next(turns)) < num_chunks:
        memmove(*chunks[i])


def _flat_pair(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether a byte-for-byte copy of ``src`` over ``dst`` is what ``dst.copy_(src)`` does."""
    return (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous())
