"""Large data sections moved in a tight ``readv``/``writev`` loop on the event loop's thread.

The event loop reads one chunk per wakeup; a put or get of megabytes then costs hundreds of
wakeups. Once ``BULK_MIN`` bytes or more are left to receive (or to send), a connection moves
them itself while the bytes keep flowing, and hands what is left back to the transport when
the peer stalls for ``BULK_WAIT_MS``, falls behind ``BULK_RATE`` (after ``BULK_GRACE`` bytes),
or after ``BULK_MAX_S``: a slow or trickling peer holds the loop a millisecond or two.
"""

from __future__ import annotations

import os
import select
import time

from kvstore.tiers.slab import IOV_MAX

BULK_MIN = 256 << 10  # bytes left in a data section from which it is moved in a tight loop
BULK_WAIT_MS = 1  # a peer silent this long gets its bytes moved by the transport again
BULK_RATE = 100e6  # bytes/s a peer must keep up (after BULK_GRACE bytes) for the loop to wait on it
BULK_GRACE = 64 << 10
BULK_MAX_S = 0.05  # the longest one tight loop holds the event loop


class BulkPace:
    """One tight loop's clock: whether to keep waiting on its peer."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.moved = 0  # bytes moved so far

    def keeps_up(self) -> bool:
        elapsed = time.monotonic() - self.start
        return elapsed < BULK_MAX_S and self.moved + BULK_GRACE >= BULK_RATE * elapsed


def move_while_flowing(fd: int, parts: list[memoryview], *, write: bool) -> int:
    """``readv`` into (``writev`` from) ``parts`` in a tight loop while the peer keeps pace;
    ``parts`` is trimmed to what is left. Stops when the peer stalls (BulkPace), at the end of
    the stream, or at an error, which the transport's own next read or write then meets.
    Returns the bytes moved."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT if write else select.POLLIN)
    move = os.writev if write else os.readv
    pace = BulkPace()
    while parts:
        try:
            n = move(fd, parts[:IOV_MAX])
        except BlockingIOError:
            if not pace.keeps_up() or not poller.poll(BULK_WAIT_MS):
                break
            continue
        except OSError:
            break
        if n == 0:  # end of stream
            break
        pace.moved += n
        trim(parts, n)
    return pace.moved


def trim(parts: list[memoryview], nbytes: int) -> None:
    """Drop the first ``nbytes`` of ``parts`` (whole parts, then the front of one)."""
    done = 0
    while nbytes and nbytes >= len(parts[done]):
        nbytes -= len(parts[done])
        done += 1
    del parts[:done]
    if nbytes:
        parts[0] = parts[0][nbytes:]
