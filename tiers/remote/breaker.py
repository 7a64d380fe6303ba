"""A per-node circuit breaker: stop asking a node that keeps failing, probe it later.

    closed --(threshold consecutive failures)--> open --(cooldown elapsed)--> half-open
    half-open: one caller probes; success -> closed, failure -> open again (cooldown doubles,
    up to max_cooldown_s)

While open, requests to the node are not sent at all: its keys are misses (or dropped writes)
at once, so a dead node costs nothing per request beyond the counting.
"""

from __future__ import annotations

import threading
import time

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    """Thread-safe. ``allow()`` before a request, then ``success()`` or ``failure()``."""

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

    def allow(self) -> bool:
        """May a request go to the node now? In half-open state only one caller at a time."""
        with self._lock:
            if self._state == CLOSED:
                return True
            if self._state == OPEN and time.monotonic() - self._opened_at < self._cooldown_s:
                return False
            if self._probing:
                return False
            self._state, self._probing = HALF_OPEN, True
            return True

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
