"""Belady's offline optimum as an eviction policy: evict the block needed farthest in the future.

It needs the whole trace first, so it lives here and not in ``kvstore.policy.eviction.POLICIES``. The
replay moves a shared clock (``FutureIndex.now``, the request being served); every tier's
policy reads next uses from the same index, so the cascade replays it like any other policy.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from kvstore.policy.eviction import EvictionPolicy, Key

NEVER = 1 << 62  # next use of a block the trace never asks for again


class FutureIndex:
    """For every key, the (request, position) of each use, as one sortable integer.

    A use is ``request * stride + position``: later requests sort later and, within one request,
    deeper blocks sort later, so the farthest next use is also the deepest block of the last
    request to come back (a prefix hit stops at the first miss: losing the tail costs least).
    """

    def __init__(self, chains: Sequence[Sequence[Key]]) -> None:
        self.stride = max((len(c) for c in chains), default=0) + 1
        self.now = -1  # the request being served; the replay sets it before each request
        self._uses: dict[Key, list[int]] = {}
        self._next: dict[Key, int] = {}  # key -> index of its first use not yet in the past
        for request, chain in enumerate(chains):
            base = request * self.stride
            for position, key in enumerate(chain):
                self._uses.setdefault(key, []).append(base + position)

    def next_use(self, key: Key) -> int:
        """The key's first use in a request after ``now``; NEVER if none (or unknown)."""
        uses = self._uses.get(key)
        if uses is None:
            return NEVER
        i = self._next.get(key, 0)
        horizon = (self.now + 1) * self.stride
        while i < len(uses) and uses[i] < horizon:
            i += 1
        self._next[key] = i
        return uses[i] if i < len(uses) else NEVER


class BeladyPolicy(EvictionPolicy):
    """Evicts the tracked block whose next use is farthest; a heap with lazy deletion.

    Each touch pushes (-next use, tiebreak, key) and records the entry's tiebreak; older heap
    entries of the key are stale and skipped when popped. O(log n) per touch and per victim.
    """

    name = "belady"

    def __init__(self, future: FutureIndex) -> None:
        self.future = future
        self._live: dict[Key, int] = {}  # key -> tiebreak of its current heap entry
        self._heap: list[tuple[int, int, Key]] = []
        self._counter = itertools.count()

    def insert(self, keys: Sequence[Key], parents: Sequence[Key | None]) -> None:
        self.access(keys)

    def access(self, keys: Sequence[Key]) -> None:
        heap, live, next_use = self._heap, self._live, self.future.next_use
        for key in keys:
            tiebreak = next(self._counter)
            live[key] = tiebreak
            heapq.heappush(heap, (-next_use(key), tiebreak, key))
        if len(heap) > 4 * len(live) + 1024:  # drop stale entries so the heap stays O(n)
            self._heap = [e for e in heap if live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def remove(self, key: Key) -> None:
        self._live.pop(key, None)

    def cool(self, keys: Sequence[Key]) -> None:
        """A hint the optimum needs none of: it knows every block's next use already."""

    def pop_victim(self, can_evict: Callable[[Key], bool] | None = None) -> Key | None:
        heap, live = self._heap, self._live
        held: list[tuple[int, int, Key]] = []
        victim: Key | None = None
        while heap:
            entry = heapq.heappop(heap)
            key = entry[2]
            if live.get(key) != entry[1]:
                continue  # stale: touched again or removed since this entry was pushed
            if can_evict is None or can_evict(key):
                del live[key]
                victim = key
                break
            held.append(entry)
        for entry in held:
            heapq.heappush(heap, entry)
        return victim

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def check_integrity(self) -> None:
        live_entries = {e[2] for e in self._heap if self._live.get(e[2]) == e[1]}
        assert live_entries == self._live.keys(), "a tracked block has no live heap entry"
