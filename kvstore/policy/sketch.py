"""FrequencySketch: a count-min sketch of block accesses with aging, for TinyLFU admission.

Four rows of small saturating counters (at most 15, as TinyLFU's 4-bit counters) indexed by
double hashing of the key's first 16 bytes (keys are SHA-256 or xxh3 digests: uniform
already). ``add`` counts one access of each key; ``estimate`` is the smallest of a key's four
counters, an over-estimate only by collisions. Aging: every ``sample`` additions all counters
are halved, so the sketch ranks blocks by recent popularity, not by all-time counts.

Memory: ``4 x width`` 16-bit counters (width = the next power of two of twice the capacity it
serves, at least 1,024): 64 KiB for a 4,096-block tier.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

ROWS = 4
MAX_COUNT = 15
MIN_WIDTH = 1024
SAMPLE_FACTOR = 10  # additions between halvings, per block of capacity (TinyLFU's W = 10 x C)


class FrequencySketch:
    """Approximate access counts of keys, recent accesses weighing most.

    Args:
        capacity: blocks of the tier whose admission it serves: sizes the rows and the
            aging period (``SAMPLE_FACTOR x capacity`` additions).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a frequency sketch needs a capacity of at least 1 block, got {capacity}")
        width = MIN_WIDTH
        while width < 2 * capacity:
            width <<= 1
        self.width = width
        self.sample = SAMPLE_FACTOR * capacity
        self._mask = np.uint64(width - 1)
        self._table = np.zeros((ROWS, width), dtype=np.uint16)
        self._added = 0
        self.num_halvings = 0

    def _indices(self, keys: Sequence[Hashable]) -> np.ndarray:
        """``[ROWS, n]`` counter indices of ``keys`` (double hashing over two 64-bit halves)."""
        if all(isinstance(k, bytes) and len(k) >= 16 for k in keys):
            halves = np.frombuffer(b"".join([k[:16] for k in keys]), dtype=np.uint64).reshape(len(keys), 2)  # type: ignore[index]
            h1, h2 = halves[:, 0], halves[:, 1] | np.uint64(1)
        else:  # keys that are not digests: Python's hash, spread by a multiplier
            base = np.array([hash(k) & 0xFFFFFFFFFFFFFFFF for k in keys], dtype=np.uint64)
            h1 = base * np.uint64(0x9E3779B97F4A7C15)
            h2 = (base ^ (base >> np.uint64(29))) * np.uint64(0xBF58476D1CE4E5B9) | np.uint64(1)
        rows = np.arange(ROWS, dtype=np.uint64)[:, None]
        with np.errstate(over="ignore"):  # wrapping arithmetic is the point
            return ((h1[None, :] + rows * h2[None, :]) & self._mask).astype(np.intp)

    def add(self, keys: Sequence[Hashable]) -> None:
        """Count one access of each of ``keys``; halve every counter each ``sample`` additions."""
        if not keys:
            return
        table = self._table
        for row, idx in enumerate(self._indices(keys)):
            counts = table[row]
            np.add.at(counts, idx, 1)
            counts[idx] = np.minimum(counts[idx], MAX_COUNT)
        self._added += len(keys)
        while self._added >= self.sample:
            table >>= 1
            self._added -= self.sample // 2
            self.num_halvings += 1

    def estimate(self, keys: Sequence[Hashable]) -> list[int]:
        """Each key's estimated recent access count (0 to ``MAX_COUNT``)."""
        if not keys:
            return []
        idx = self._indices(keys)
        found = self._table[np.arange(ROWS)[:, None], idx].min(axis=0)
        return [int(v) for v in found]
