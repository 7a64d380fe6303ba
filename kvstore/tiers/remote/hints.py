"""What the remote tier learned lately, kept a moment so that a repeated question costs no trip.

Two bounded, short-lived maps, both keyed by block key:

- ``Hints``: whether the remote held a block when last asked (a GET's value or nil, an
  EXISTS's 1 or 0, a write this tier made, a delete it sent). A lookup answers from a fresh
  hint without asking, so a prefix the cluster does not hold costs one round trip per
  ``ttl_s``, not one per request; a read never GETs past a fresh absent hint. A hint is only
  a hint: a present one never delivers bytes (the GET and its checksum decide), and an absent
  one hides a block another node writes for at most ``ttl_s``.
- ``KeptValues``: values a lookup fetched (a short run: GET cost about what EXISTS does),
  kept for the read that follows, which takes each once and checks it again, checksum
  included, before copying it. Bounded in bytes; a value not taken within ``ttl_s`` is
  dropped.

Both are thread-safe. Entries past the bound go oldest first.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

HINT_TTL_S = 1.0  # how long an answer stands: a block another node writes is seen at most this late
MAX_HINTS = 1 << 16  # ~100 bytes each: ~6 MiB at most
KEPT_TTL_S = HINT_TTL_S  # a lookup's values wait this long for the read that follows it (no longer than its hints)
KEPT_BYTES = 16 << 20


class Hints:
    """Block key -> (held, expiry); answers only while fresh."""

    def __init__(self, ttl_s: float = HINT_TTL_S, max_entries: int = MAX_HINTS) -> None:
        if ttl_s < 0 or max_entries < 1:
            raise ValueError(f"hints need ttl_s >= 0 and max_entries >= 1, got {ttl_s}, {max_entries}")
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def known(self, keys: Sequence[bytes]) -> list[bool | None]:
        """Per key: True (held), False (not held) while its hint is fresh, else None."""
        now = time.monotonic()
        out: list[bool | None] = []
        with self._lock:
            for key in keys:
                found = self._entries.get(key)
                out.append(found[0] if found is not None and found[1] > now else None)
        return out

    def note(self, keys: Sequence[bytes], held: Sequence[bool] | bool) -> None:
        """Record what the remote said of ``keys`` just now (one flag for all, or one each)."""
        if self.ttl_s == 0 or not keys:
            return
        flags = [held] * len(keys) if isinstance(held, bool) else held
        expiry = time.monotonic() + self.ttl_s
        with self._lock:
            entries = self._entries
            for key, flag in zip(keys, flags, strict=True):
                entries[key] = (flag, expiry)
                entries.move_to_end(key)
            while len(entries) > self.max_entries:
                entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


class KeptValues:
    """Block key -> a value as the remote sent it (header and payload, checked once), taken once."""

    def __init__(self, ttl_s: float = KEPT_TTL_S, max_bytes: int = KEPT_BYTES) -> None:
        if ttl_s < 0 or max_bytes < 0:
            raise ValueError(f"kept values need ttl_s >= 0 and max_bytes >= 0, got {ttl_s}, {max_bytes}")
        self.ttl_s, self.max_bytes = ttl_s, max_bytes
        self._lock = threading.Lock()
        self._values: OrderedDict[bytes, tuple[Any, float]] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._values)

    def has(self, key: bytes) -> bool:
        """Whether a fresh value of ``key`` waits to be taken."""
        with self._lock:
            found = self._values.get(key)
            return found is not None and found[1] > time.monotonic()

    def keep(self, keys: Sequence[bytes], values: Sequence[Any]) -> None:
        """Keep ``values[i]`` (a buffer) for ``keys[i]``; the oldest go past ``max_bytes``."""
        if self.ttl_s == 0 or self.max_bytes == 0:
            return
        expiry = time.monotonic() + self.ttl_s
        with self._lock:
            for key, value in zip(keys, values, strict=True):
                old = self._values.pop(key, None)
                if old is not None:
                    self.num_bytes -= len(old[0])
                self._values[key] = (value, expiry)
                self.num_bytes += len(value)
            self._trim(time.monotonic())

    def take(self, keys: Sequence[bytes]) -> list[Any]:
        """Per key: its fresh value, removed; else None."""
        now = time.monotonic()
        out: list[Any] = []
        with self._lock:
            for key in keys:
                found = self._values.pop(key, None)
                if found is not None:
                    self.num_bytes -= len(found[0])
                out.append(found[0] if found is not None and found[1] > now else None)
            self._trim(now)
        return out

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self.num_bytes = 0

    def drop(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                found = self._values.pop(key, None)
                if found is not None:
                    self.num_bytes -= len(found[0])

    def _trim(self, now: float) -> None:
        values = self._values
        while values and (self.num_bytes > self.max_bytes or next(iter(values.values()))[1] <= now):
            _key, (value, _expiry) = values.popitem(last=False)
            self.num_bytes -= len(value)
