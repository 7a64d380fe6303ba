"""Asynchronous transfers: the handle that ``TieredStore.fetch`` returns."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass


@dataclass(frozen=True)
class FetchResult:
    """What a fetch delivered.

    Attributes:
        num_blocks: the leading run of blocks copied into the destination with verified bytes.
            Blocks after it (missing, evicted meanwhile, corrupt, I/O error) were not copied:
            the caller recomputes them.
        tiers: the tier each delivered block was read from.
    """

    num_blocks: int
    tiers: tuple[str, ...]


class FetchHandle:
    """A future-like handle on an asynchronous fetch."""

    def __init__(self, future: Future[FetchResult], num_requested: int) -> None:
        self._future = future
        self.num_requested = num_requested

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> FetchResult:
        """Wait for the copy; raises what the transfer raised, TimeoutError after ``timeout``."""
        return self._future.result(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds; True when the fetch has finished."""
        try:
            self._future.exception(timeout)
        except TimeoutError:
            return False
        return True

    def add_done_callback(self, fn: Callable[[FetchHandle], object]) -> None:
        """Call ``fn(handle)`` when the fetch finishes (at once if it already has)."""
        self._future.add_done_callback(lambda _f: fn(self))
