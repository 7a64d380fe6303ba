"""A per-node circuit breaker: stop asking a node that keeps failing, probe it later.

    closed --(threshold consecutive failures)--> open --(cooldown elapsed)--> half-open
    half-open: one probe goes out; success -> closed, failure -> open again (cooldown doubles,
    up to max_cooldown_s)

While open, requests to the node are not sent at all: its keys are misses (or dropped writes)
at once, so a dead node costs nothing per request beyond the counting. ``should_probe`` hands
the probe to the owner, which sends it on a thread of its own: no caller ever waits on a node
that is still down.
"""

from __future__ import annotations

import threading
import time

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    """Thread-safe. Requests go out while ``is_closed``; each reports ``success()`` or
    ``failure()``, and so does the probe that ``should_probe()`` asks for."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 0.5, max_cooldown_s: float = 5.0) -> None:
        if threshold < 1 or cooldown_s <= 0 or max_cooldown_s < cooldown_s:
            raise ValueError(f"bad breaker settings: threshold={threshold}, cooldown_s={cooldown_s}, "
                             f"max_cooldown_s={max_cooldown_s}")
        self.threshold, self.base_cooldown_s, self.max_cooldown_s = threshold, cooldown_s, max_cooldown_s
        self._lock = threading.Lock()
        self._failures = 0
        self._state = CLOSED
        self._cooldown_s = cooldown_s
        self._opened_at = 0.0
        self._probing = False
        self.num_opened = 0

    @property
    def state(self) -> str:
        with self._lock:
            if self._state == OPEN and time.monotonic() - self._opened_at >= self._cooldown_s:
                return HALF_OPEN
            return self._state

    def should_probe(self) -> bool:
        """True once per cool-down: the caller sends a probe (and reports its outcome) while
        requests keep being refused until the probe succeeds."""
        with self._lock:
            if self._state == CLOSED or self._probing:
                return False
            if self._state == OPEN and time.monotonic() - self._opened_at < self._cooldown_s:
                return False
            self._state, self._probing = HALF_OPEN, True
            return True

    @property
    def is_closed(self) -> bool:
        with self._lock:
            return self._state == CLOSED

    def success(self) -> None:
        with self._lock:
            self._failures, self._state, self._probing = 0, CLOSED, False
            self._cooldown_s = self.base_cooldown_s

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._state == HALF_OPEN:
                self._cooldown_s = min(self.max_cooldown_s, 2 * self._cooldown_s)
                self._open()
            elif self._state == CLOSED and self._failures >= self.threshold:
                self._open()

    def _open(self) -> None:
        self._state, self._probing, self._opened_at = OPEN, False, time.monotonic()
        self.num_opened += 1
