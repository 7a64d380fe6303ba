"""Free-slot bookkeeping for a slab: maximal runs of free slots, best-fit allocation.

A run of blocks of one prefix should land in consecutive slots so that it reads back with one
``preadv``. ``FreeExtents`` keeps the free slots as maximal extents ``[start, start + length)``
and hands out the smallest extent that fits a request whole (best fit keeps long runs long).

Invariants (checked by ``check``):
  * extents are disjoint and never adjacent (freeing merges with both neighbours);
  * ``num_free`` is the sum of extent lengths;
  * ``_lengths`` is the sorted list of distinct lengths present, so best fit is one bisect.
    There are at most ~sqrt(2 * num_slots) distinct lengths, so keeping it sorted is cheap.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable


class FreeExtents:
    """The free slots of one slab as maximal extents."""

    def __init__(self) -> None:
        self._length_at: dict[int, int] = {}  # start -> length
        self._start_ending_at: dict[int, int] = {}  # end (exclusive) -> start
        self._starts_by_length: dict[int, set[int]] = {}
        self._lengths: list[int] = []  # sorted distinct keys of _starts_by_length
        self.num_free = 0

    def _insert(self, start: int, length: int) -> None:
        self._length_at[start] = length
        self._start_ending_at[start + length] = start
        bucket = self._starts_by_length.get(length)
        if bucket is None:
            self._starts_by_length[length] = bucket = set()
            insort(self._lengths, length)
        bucket.add(start)

    def _remove(self, start: int) -> int:
        length = self._length_at.pop(start)
        del self._start_ending_at[start + length]
        bucket = self._starts_by_length[length]
        bucket.discard(start)
        if not bucket:
            del self._starts_by_length[length]
            del self._lengths[bisect_left(self._lengths, length)]
        return length

    def add(self, start: int, length: int) -> None:
        """Mark ``[start, start + length)`` free, merging with free neighbours.

        The caller guarantees the range is not already free (the tier's slot states say so).
        """
        if length <= 0:
            return
        self.num_free += length
        left = self._start_ending_at.get(start)
        if left is not None:
            length += start - left
            self._remove(left)
            start = left
        if start + length in self._length_at:
            length += self._remove(start + length)
        self._insert(start, length)

    def add_slots(self, slots: Iterable[int]) -> None:
        """Mark single slots free, grouping consecutive ones into runs first."""
        ordered = sorted(slots)
        i = 0
        while i < len(ordered):
            j = i + 1
            while j < len(ordered) and ordered[j] == ordered[j - 1] + 1:
                j += 1
            self.add(ordered[i], j - i)
            i = j

    def _take_from(self, length: int, count: int) -> list[int]:
        # Lowest start among few candidates keeps allocations packed toward the file's head;
        # large buckets take any member to stay O(1).
        bucket = self._starts_by_length[length]
        start = min(bucket) if len(bucket) <= 32 else next(iter(bucket))
        self._remove(start)
        if count < length:
            self._insert(start + count, length - count)
        self.num_free -= count
        return list(range(start, start + count))

    def take(self, count: int) -> list[int]:
        """Remove and return ``count`` free slots, contiguous whenever one extent can hold them.

        Otherwise the largest extents are taken whole first (fewest fragments), each fragment in
        ascending order. The caller checks ``count <= num_free``.
        """
        if count > self.num_free:
            raise ValueError(f"need {count} slots, {self.num_free} free")
        slots: list[int] = []
        need = count
        while need > 0:
            i = bisect_left(self._lengths, need)
            if i < len(self._lengths):
                slots += self._take_from(self._lengths[i], need)
                break
            largest = self._lengths[-1]
            slots += self._take_from(largest, largest)
            need -= largest
        return slots

    def extents(self) -> list[tuple[int, int]]:
        """All free extents as sorted ``(start, length)`` pairs."""
        return sorted(self._length_at.items())

    def check(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        total = 0
        previous_end = -1
        for start, length in self.extents():
            if length <= 0:
                raise AssertionError(f"free extent at {start} has length {length}")
            if start <= previous_end:
                raise AssertionError(
                    f"free extent at {start} overlaps or touches the one ending at {previous_end}"
                )
            if self._start_ending_at.get(start + length) != start:
                raise AssertionError(f"free extent [{start}, {start + length}) missing from the end map")
            if start not in self._starts_by_length.get(length, ()):
                raise AssertionError(
                    f"free extent [{start}, {start + length}) missing from its length bucket"
                )
            previous_end = start + length
            total += length
        if total != self.num_free:
            raise AssertionError(f"free extents hold {total} slots but num_free is {self.num_free}")
        if self._lengths != sorted(self._starts_by_length):
            raise AssertionError("sorted length list disagrees with the length buckets")
