"""What a store returns: every small typed result of the BlockStore contract (kvstore/api.py).

Plain values and handles, never index entries: the embedded store, the daemon client and the
vLLM connector's guarded store all return these, so a caller never learns which one it holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

# The tier names results carry (``PrefixMatch.tiers``, ``stats()`` keys), fastest first.
HOST = "host"
DISK = "disk"
REMOTE = "remote"


@dataclass(frozen=True)
class PrefixMatch:
    """The answer of a lookup: the leading run of keys some tier holds.

    Attributes:
        num_blocks: length of the leading run of found blocks (a lookup stops at the first miss).
        tiers: for each found block, the fastest tier holding it ("host", "disk", ...).
        lossy: for each found block, whether that copy differs from the bytes put (a lossy
            codec's); empty when the lookup did not say.
    """

    num_blocks: int
    tiers: tuple[str, ...] = field(default=())
    lossy: tuple[bool, ...] = field(default=(), compare=False)

    def count(self, tier: str) -> int:
        return self.tiers.count(tier)


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


@dataclass(frozen=True)
class BlockInfo:
    """Where one block is and how it is held (``inspect``).

    Attributes:
        key: the block's key as the store files it.
        tiers: every tier holding it, fastest first ("remote" when the remote tier said so).
        codecs: per tier, the codec its copy is stored with ("none": the bytes put).
        stored_bytes: per tier, the bytes that tier stores for it (its encoded size).
        tenant: whose block it is (None: only the remote tier holds it, and it does not say).
        pins: pins held on it now (pins of every holder).
        pin_expires_s: seconds until its last pin ends by itself; None when unpinned or some
            pin has no deadline.
    """

    key: bytes
    tiers: tuple[str, ...]
    codecs: dict[str, str] = field(default_factory=dict)
    stored_bytes: dict[str, int] = field(default_factory=dict)
    tenant: str | None = None
    pins: int = 0
    pin_expires_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON- and msgpack-ready (the key as hex)."""
        return {"key": self.key.hex(), "tiers": list(self.tiers), "codecs": dict(self.codecs),
                "stored_bytes": dict(self.stored_bytes), "tenant": self.tenant, "pins": self.pins,
                "pin_expires_s": self.pin_expires_s}


class PrefetchHandle:
    """A prefetch under way: ``result()`` is how many of its blocks are in host RAM once done.

    ``poll(wait_s)`` answers the result once the prefetch is done, else None after waiting up
    to ``wait_s`` seconds; it raises what the prefetch raised.
    """

    def __init__(self, num_requested: int, poll: Callable[[float], int | None]) -> None:
        self.num_requested = num_requested
        self._poll = poll
        self._result: int | None = None

    @classmethod
    def of_future(cls, future: Future[int], num_requested: int) -> PrefetchHandle:
        def poll(wait_s: float) -> int | None:
            try:
                return future.result(wait_s)
            except FutureTimeout:
                return None
        return cls(num_requested, poll)

    @classmethod
    def finished(cls, num_blocks: int, num_requested: int) -> PrefetchHandle:
        return cls(num_requested, lambda _wait: num_blocks)

    def done(self) -> bool:
        return self._answer(0.0) is not None

    def result(self, timeout: float | None = None) -> int:
        """Wait for the prefetch; TimeoutError after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            found = self._answer(left)
            if found is not None:
                return found
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"the prefetch of {self.num_requested} blocks is not done after {timeout} s")

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds; True when the prefetch is done."""
        try:
            self.result(timeout)
        except TimeoutError:
            return False
        return True

    def _answer(self, wait_s: float) -> int | None:
        if self._result is None:
            self._result = self._poll(wait_s)
        return self._result


@dataclass(frozen=True)
class ForgetReport:
    """What forgetting a tenant did.

    Attributes:
        tenant: the tenant forgotten.
        deleted: per tier, blocks of the tenant that tier held and no longer holds (the
            remote tier's count covers every store that wrote to it).
        num_blocks: distinct blocks deleted from the local tiers.
        pins_released: pins those blocks held (of any holder, pins with a TTL included).
        failures: what could not be done (a remote node not swept whole); empty when complete.
    """

    tenant: str
    deleted: dict[str, int] = field(default_factory=dict)
    num_blocks: int = 0
    pins_released: int = 0
    failures: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "deleted": dict(self.deleted), "num_blocks": self.num_blocks,
                "pins_released": self.pins_released, "complete": self.complete, "failures": list(self.failures)}
