"""Write-behind: blocks reach the remote tier on a background thread, never on the caller's.

A bounded queue of encoded values (each a private copy, so the caller's memory may be reused
at once). ``offer`` never blocks: when the queue is full the block is dropped and counted.
One thread drains it in batches through a ``send`` callable (the tier's existence check plus
SET). ``flush`` waits until everything offered before it was sent or counted as dropped.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PendingWrite:
    name: bytes
    value: bytes
    key: bytes


Send = Callable[[list[PendingWrite]], object]


class WriteBehind:
    """One writer thread over a queue of at most ``max_blocks`` pending values."""

    def __init__(self, send: Send, max_blocks: int, batch_blocks: int, on_drop: Callable[[int], None]) -> None:
        if max_blocks < 1 or batch_blocks < 1:
            raise ValueError(f"write-behind needs max_blocks >= 1 and batch_blocks >= 1, got "
                             f"{max_blocks} and {batch_blocks}")
        self.max_blocks, self.batch_blocks = max_blocks, batch_blocks
        self._send, self._on_drop = send, on_drop
        self._queue: deque[PendingWrite] = deque()
        self._cond = threading.Condition()
        self._offered = 0  # blocks accepted into the queue, ever
        self._done = 0  # of those, sent or given up on
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-remote-writer", daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        with self._cond:
            return self._offered - self._done

    def offer(self, items: list[PendingWrite]) -> int:
        """Queue what fits; the rest is dropped (counted through ``on_drop``). Returns how many
        were queued."""
        with self._cond:
            room = 0 if self._closed else max(0, self.max_blocks - len(self._queue))
            taken = items[:room]
            self._queue.extend(taken)
            self._offered += len(taken)
            if taken:
                self._cond.notify_all()
        if len(items) > len(taken):
            self._on_drop(len(items) - len(taken))
        return len(taken)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block offered so far is sent or dropped; False on timeout."""
        with self._cond:
            target = self._offered
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                n = min(self.batch_blocks, len(self._queue))
                batch = [self._queue.popleft() for _ in range(n)]
            try:
                self._send(batch)
            except Exception:  # the tier's send counts its own failures; this is a last guard
                self._on_drop(len(batch))
            finally:
                with self._cond:
                    self._done += len(batch)
                    self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Stop taking blocks, send what is queued (up to ``timeout``), stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
