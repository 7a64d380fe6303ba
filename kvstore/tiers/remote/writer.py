"""Write-behind: blocks reach the remote tier on a background thread, never on the caller's.

A bounded queue of encoded values (each a private copy, so the caller's memory may be reused
at once). Admission is two-phase, so a block that will not fit is never copied: ``reserve(n)``
claims room for as many of ``n`` blocks as fit now (the rest are dropped and counted at once),
the caller frames only those, and ``Room.fill`` queues them; room it leaves unused is counted
as dropped too. Neither step blocks. The bound covers every value that exists: queued, being
sent, or being framed into claimed room, so at most ``max_blocks`` values are held at once.
One thread drains the queue in batches through a ``send`` callable (the tier's existence
check plus SET). ``flush`` waits until everything queued before it was sent or given up on.
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
    owner: bytes = b""  # the value's owner tag (tiers.remote.codec)


Send = Callable[[list[PendingWrite]], object]


class Room:
    """Room ``WriteBehind.reserve`` claimed for up to ``size`` blocks. ``fill`` queues blocks
    into it, once; on leaving its ``with`` block (or at ``fill``) the room is given back, and
    every block of ``size`` not queued is counted as dropped."""

    def __init__(self, writer: WriteBehind, size: int) -> None:
        self.size = size
        self._writer = writer
        self._open = True

    def fill(self, items: list[PendingWrite]) -> int:
        """Queue ``items`` (at most ``size``); returns how many were queued (none once the
        writer is closed)."""
        if len(items) > self.size:
            raise ValueError(f"{len(items)} blocks offered into room for {self.size}")
        if not self._open:
            raise RuntimeError("this room was filled or released already")
        self._open = False
        return self._writer._fill(self.size, items)

    def __enter__(self) -> Room:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._open:
            self._open = False
            self._writer._fill(self.size, [])


class WriteBehind:
    """One writer thread over at most ``max_blocks`` pending values (claimed, queued or sent)."""

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
        self._claimed = 0  # room reserved and not yet filled or released
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-remote-writer", daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        with self._cond:
            return self._offered - self._done

    def reserve(self, n: int) -> Room:
        """Claim room for as many of ``n`` blocks as fit now; the others are dropped (counted
        through ``on_drop``) before anyone copies them. Never blocks."""
        with self._cond:
            held = (self._offered - self._done) + self._claimed  # queued + being sent + claimed
            size = 0 if self._closed else max(0, min(n, self.max_blocks - held))
            self._claimed += size
        if n > size:
            self._on_drop(n - size)
        return Room(self, size)

    def _fill(self, size: int, items: list[PendingWrite]) -> int:
        """Give back a room of ``size`` and queue ``items`` in it (Room.fill, Room.__exit__)."""
        with self._cond:
            self._claimed -= size
            taken = [] if self._closed else items  # the thread may have ended: nothing would send them
            self._queue.extend(taken)
            self._offered += len(taken)
            if taken:
                self._cond.notify_all()
        if size > len(taken):
            self._on_drop(size - len(taken))
        return len(taken)

    def discard(self, owner: bytes) -> int:
        """Drop the queued (not yet sending) blocks of ``owner``, counted as dropped; how many."""
        with self._cond:
            kept = deque(item for item in self._queue if item.owner != owner)
            n = len(self._queue) - len(kept)
            self._queue = kept
            self._done += n
            if n:
                self._cond.notify_all()
        if n:
            self._on_drop(n)
        return n

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
