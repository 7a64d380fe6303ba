"""The suite's one way to wait for what another thread or process does: poll a check until it
holds, or fail, naming what never happened, once a deadline passes.

A test that waits says what for (``what``) and for how long at most (``timeout``); it never
sleeps a fixed time and hopes. ``wait_until`` returns the check's own value, so a check that
reads something (a stats dict, a view) hands that to the assertions after it.

``wait_blocked`` is the same wait for a thread that must block: a test asserting that a call
waits (for a lock, a write, a reader) first waits until the call's thread is inside the
function that blocks, read from the thread's own stack, and only then asserts that it stays
there. A thread found alive after a fixed sleep proves nothing: it may never have got that far.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import uvicorn

T = TypeVar("T")

POLL_S = 0.02  # short: a wait ends within this of the moment its check first holds


def wait_until(check: Callable[[], T | None], timeout: float, what: str | Callable[[], str], *,
               ignoring: tuple[type[Exception], ...] = (), poll_s: float = POLL_S) -> T:
    """Calls ``check`` until it returns a true value, and returns that value.

    Args:
        check: Reads the state waited for; true once it holds. Called at least once, even with
            a timeout of 0, and once more after the deadline, so a slow check is not cut short.
        timeout: Seconds to wait at most.
        what: What is waited for, for the failure message; a callable is called only then (the
            state worth printing, e.g. a subscriber's counters at the moment it failed).
        ignoring: Exceptions of ``check`` that mean "not yet" (a server not listening yet).
        poll_s: Seconds between two calls of ``check``.

    Returns:
        The first true value ``check`` returned.

    Raises:
        AssertionError: ``check`` did not hold within ``timeout`` seconds; the message names
            ``what``, the timeout and the last value (or exception) ``check`` gave.
    """
    deadline = time.monotonic() + timeout
    while True:
        last_try = time.monotonic() >= deadline
        try:
            value = check()
        except ignoring as e:
            last: object = e
        else:
            if value:
                return value
            last = value
        if last_try:
            said = what() if callable(what) else what
            raise AssertionError(f"{said}: not within {timeout:g} s (last: {last!r})")
        time.sleep(poll_s)


def inside(thread: threading.Thread, *functions: str) -> bool:
    """Whether ``thread`` is now in a call of one of ``functions`` (plain function names, such as
    ``wait_written``), as its current stack says."""
    # sys._current_frames() allocates while it holds the interpreter's thread-list lock; a
    # collection set off there that frees a threading.local takes that lock again and hangs
    # the process (CPython 3.11): no collection runs inside it
    collecting = gc.isenabled()
    gc.disable()
    try:
        frame = sys._current_frames().get(thread.ident or -1)
    finally:
        if collecting:
            gc.enable()
    while frame is not None:
        if frame.f_code.co_name in functions:
            return True
        frame = frame.f_back
    return False


def wait_blocked(thread: threading.Thread, *functions: str, what: str, timeout: float = 30.0) -> None:
    """Returns once ``thread`` is in a call of one of ``functions``: the point where it blocks.

    Raises:
        AssertionError: ``thread`` ended first, or did not get there within ``timeout`` seconds.
    """

    def there() -> bool:
        if inside(thread, *functions):
            return True
        if not thread.is_alive():
            raise AssertionError(f"{what}: the thread ended instead of blocking in {' or '.join(functions)}")
        return False

    wait_until(there, timeout, f"{what} (blocked in {' or '.join(functions)})")


def wait_serving(server: uvicorn.Server, thread: threading.Thread, timeout: float = 30.0) -> None:
    """Returns once the uvicorn ``server`` that ``thread`` runs is serving.

    Raises:
        AssertionError: ``thread`` ended first (the server could not start), or ``timeout``
            seconds passed.
    """

    def started() -> bool:
        if not thread.is_alive():
            raise AssertionError("uvicorn did not start: its thread ended")
        return bool(server.started)

    wait_until(started, timeout, "uvicorn serving")
