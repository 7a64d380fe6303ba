"""Eviction policies: strategy objects that order one tier's blocks for eviction.

A policy holds keys only, never bytes or slots; the tier holds the bytes and ``TieredStore``
decides what happens to a victim (demote or drop). The same objects drive ``kvstore replay``.

The family stays in one module (about 410 lines): the interface, both policies (``lru``,
``reuse``), the deferred wrapper and the factory read together, so that what the interface
promises (tails before heads, pinned blocks skipped) is checked against each policy in place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import ClassVar

Key = Hashable


class EvictionPolicy(ABC):
    """Orders the blocks of one tier for eviction.

    Chains are always passed in prefix order (root first). A policy must evict a chain's tail
    blocks before its head when both were last used together, so a prefix is never cut in
    the middle while its tail stays cached.
    """

    name: ClassVar[str]

    @abstractmethod
    def insert(self, keys: Sequence[Key], parents: Sequence[Key | None]) -> None:
        """Record blocks that just entered the tier.

        Args:
            keys: keys new to this tier, in chain order.
            parents: the parent key of each (None for a chain's first block).
        """

    @abstractmethod
    def access(self, keys: Sequence[Key]) -> None:
        """Record a hit on blocks already in the tier, in chain order."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """Forget a block that left the tier for any reason. Unknown keys are ignored."""

    @abstractmethod
    def cool(self, keys: Sequence[Key]) -> None:
        """Make tracked ``keys`` (chain order) the next victims, tails first: blocks that serve
        only rarer hits than the rest (a sliding-window group's blocks below the window of the
        boundaries their chain was used at). A later access treats them as any block again.
        Unknown keys are ignored."""

    @abstractmethod
    def pop_victim(self, can_evict: Callable[[Key], bool] | None = None) -> Key | None:
        """Remove and return the next block to evict.

        Args:
            can_evict: a predicate; blocks for which it is False (pinned, in flight) are
                skipped and stay tracked.

        Returns:
            The victim's key, or None when no tracked block may be evicted.
        """

    def peek_victim(self, can_evict: Callable[[Key], bool] | None = None) -> Key | None:
        """The block ``pop_victim`` would return now, left tracked (admission compares a
        candidate with it). None when no tracked block may be evicted, or when the policy
        cannot say (this default)."""
        return None

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def check_integrity(self) -> None:
        """Assert the policy's internal invariants (tests and idle ticks call it); cheap to skip."""
        return None


class LRUPolicy(EvictionPolicy):
    """Least recently used, tail blocks first.

    A chain is touched from its tail to its root, so within one access the root is the most
    recent: a prefix's leaves leave before its shared head.
    """

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # front = least recently used

    def insert(self, keys: Sequence[Key], parents: Sequence[Key | None]) -> None:
        self.access(keys)

    def access(self, keys: Sequence[Key]) -> None:
        order = self._order
        for key in reversed(keys):
            order[key] = None
            order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def cool(self, keys: Sequence[Key]) -> None:
        order = self._order
        for key in keys:  # head first: each goes to the front, so the tail ends up first
            if key in order:
                order.move_to_end(key, last=False)

    def pop_victim(self, can_evict: Callable[[Key], bool] | None = None) -> Key | None:
        key = self.peek_victim(can_evict)
        if key is not None:
            del self._order[key]
        return key

    def peek_victim(self, can_evict: Callable[[Key], bool] | None = None) -> Key | None:
        for key in self._order:
            if can_evict is None or can_evict(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


def _bucket(interval: int) -> int:
    """Log-scale histogram bucket: four buckets per power of two (intervals below 8 exact)."""
    n = interval.bit_length()
    return interval if n <= 3 else (n << 2) | ((interval >> (n - 3)) & 3)


def _bucket_top(bucket: int) -> int:
    """The largest interval that falls in ``bucket`` (inverse of ``_bucket``)."""
    if bucket < 8:
        return bucket
    n, m = bucket >> 2, bucket & 3
    return ((5 + m) << (n - 3)) - 1


class ReusePolicy(EvictionPolicy):
    """LRU that protects reused blocks for about as long as reuses are observed to take.

    Blocks seen once sit in ``once``, blocks seen twice or more (a ghost list remembers evicted
    keys and their use counts) in ``reused``; both queues are LRU ordered by a touch clock. The
    victim is the head of ``once``, unless the head of ``reused`` is older than it AND older
    than the protection horizon: the ``quantile`` of reuse intervals (in block touches) recently
    observed on reused blocks. Horizon 0 is exactly tail-first LRU; an infinite one always
    sacrifices once-seen blocks first. The horizon starts at 0 and is learned online, so the
    policy falls back to LRU where reused blocks come back quickly or the tier is large.
    Leaves first: within one call a parent gets a use count >= its child's (so it never sits
    in a lower class) and a later stamp; ``insert`` re-stamps the tracked ancestors of the
    blocks it adds, so a found prefix accessed before its new tail is inserted stays newer.
    """

    name = "reuse"

    def __init__(self, quantile: float = 0.97, ghost_factor: float = 4.0, min_samples: int = 32) -> None:
        self.quantile, self.ghost_factor, self.min_samples = quantile, ghost_factor, min_samples
        self._once: OrderedDict[Key, int] = OrderedDict()  # key -> last touch stamp; front = oldest
        self._reused: OrderedDict[Key, int] = OrderedDict()
        self._uses: dict[Key, int] = {}  # every tracked key: its use count (capped)
        self._parents: dict[Key, Key] = {}  # tracked key -> parent, where one was given
        self._ghost: OrderedDict[Key, tuple[int, int]] = OrderedDict()  # evicted: (uses, stamp)
        self._clock = 0  # one tick per block touched
        self._high_water = 0  # the most blocks tracked at once: the tier's size once it filled
        self._ghost_limit = int(ghost_factor * 64)  # ghost_factor x high water (at least 64)
        self._histogram = [0.0] * 256  # reuse intervals of reused blocks, decayed (see _observe)
        self._num_samples = 0
        self.horizon = 0  # protection horizon in block touches; 0 until min_samples are seen

    def insert(self, keys: Sequence[Key], parents: Sequence[Key | None]) -> None:
        self._touch(keys, parents)
        if keys and parents and parents[0] is not None:
            self._restamp_ancestors(parents[0], self._uses[keys[0]])
        if len(self._uses) > self._high_water:
            self._high_water = len(self._uses)
            self._ghost_limit = int(self.ghost_factor * max(self._high_water, 64))

    def access(self, keys: Sequence[Key]) -> None:
        self._touch(keys, None)

    def _touch(self, keys: Sequence[Key], parents: Sequence[Key | None] | None) -> None:
        once, reused, uses, ghost = self._once, self._reused, self._uses, self._ghost
        clock, floor = self._clock, 0
        intervals: list[int] = []  # reuse intervals of the reused blocks, observed after the loop
        for i in range(len(keys) - 1, -1, -1):  # tail first: the head gets the newest stamp
            key = keys[i]
            clock += 1
            count = uses.get(key)
            if count is None:  # new to this tier (access of an unknown key is treated the same, as LRU does)
                count, stamp = ghost.pop(key, (0, 0))
                if parents is not None and parents[i] is not None:
                    self._parents[key] = parents[i]
                if count >= 2:
                    intervals.append(clock - stamp)
                stays = False
            elif count >= 2:  # reused, and stays so: restamped in place below
                intervals.append(clock - reused[key])
                stays = True
            else:  # seen once: it leaves ``once``
                del once[key]
                stays = False
            if count < 255:
                count += 1
            if count < floor:  # a parent never sits below its child
                count = floor
            floor = uses[key] = count
            if stays:
                reused[key] = clock
                reused.move_to_end(key)
            else:
                (reused if count >= 2 else once)[key] = clock
        self._clock = clock
        if intervals:
            self._observe(intervals)

    def _restamp_ancestors(self, parent: Key | None, floor: int) -> None:
        # The new blocks' tracked prefix counts as touched with them, after them: O(depth).
        # The step bound only guards against a parent cycle, which chained keys cannot form.
        for _ in range(len(self._uses)):
            if parent is None or parent not in self._uses:
                break
            self._clock += 1
            floor = max(self._uses[parent], floor)
            self._uses[parent] = floor
            self._once.pop(parent, None)
            self._reused.pop(parent, None)
            (self._reused if floor >= 2 else self._once)[parent] = self._clock
            parent = self._parents.get(parent)

    def _observe(self, intervals: list[int]) -> None:
        histogram = self._histogram
        # a chain read together has one interval for all its blocks: bucket each value once
        for interval, times in Counter(intervals).items():
            histogram[_bucket(interval)] += times
        before = self._num_samples
        self._num_samples += len(intervals)
        passed = self._num_samples // 256 - before // 256  # multiples of 256 samples passed
        if passed and self._num_samples >= self.min_samples:
            # Recompute the quantile, then decay: recent reuse behaviour dominates.
            target, seen = self.quantile * sum(histogram), 0.0
            for bucket, weight in enumerate(histogram):
                seen += weight
                if seen >= target:
                    self.horizon = _bucket_top(bucket)
                    break
            decay = 0.9**passed
            self._histogram = [w * decay for w in histogram]

    def remove(self, key: Key) -> None:
        if self._once.pop(key, None) is None:
            self._reused.pop(key, None)
        self._uses.pop(key, None)
        self._parents.pop(key, None)

    def cool(self, keys: Sequence[Key]) -> None:
        # Cooled blocks count as seen once and go to the front of ``once`` with stamps older
        # than any tracked block's (so ``_choose`` takes them before a reused head too; stamps
        # stay ascending), head first so that the tail is first.
        once, reused, uses = self._once, self._reused, self._uses
        for key in keys:
            if key not in uses:
                continue
            if once.pop(key, None) is None:
                reused.pop(key)
            oldest = min(next(iter(once.values()), self._clock), next(iter(reused.values()), self._clock))
            uses[key] = 1
            once[key] = oldest - 1
            once.move_to_end(key, last=False)

    def pop_victim(self, can_evict: Callable[[Key], bool] | None = None) -> Key | None:
        victim, queue = self._choose(can_evict)
        if victim is None:
            return None
        self._ghost[victim] = (self._uses.pop(victim), queue.pop(victim))
        self._parents.pop(victim, None)
        if len(self._ghost) > self._ghost_limit:
            self._ghost.popitem(last=False)
        return victim

    def peek_victim(self, can_evict: Callable[[Key], bool] | None = None) -> Key | None:
        return self._choose(can_evict)[0]

    def _choose(self, can_evict: Callable[[Key], bool] | None) -> tuple[Key | None, OrderedDict[Key, int]]:
        """The victim and the queue it sits in (``once`` when there is none)."""
        once, reused = self._once, self._reused
        first_once = first_reused = None
        if can_evict is None:
            first_once, first_reused = next(iter(once), None), next(iter(reused), None)
        else:  # hot path: plain loops, no generators
            for key in once:
                if can_evict(key):
                    first_once = key
                    break
            for key in reused:
                if can_evict(key):
                    first_reused = key
                    break
        if first_reused is None:
            return first_once, once
        if first_once is None:
            return first_reused, reused
        stamp = reused[first_reused]
        if stamp < once[first_once] and self._clock - stamp > self.horizon:
            return first_reused, reused
        return first_once, once

    def __len__(self) -> int:
        return len(self._uses)

    def __contains__(self, key: object) -> bool:
        return key in self._uses

    def check_integrity(self) -> None:
        assert len(self._once) + len(self._reused) == len(self._uses), "queues and counts disagree"
        for queue, reused in ((self._once, False), (self._reused, True)):
            stamps = list(queue.values())
            assert stamps == sorted(stamps), "a queue is out of stamp order"
            assert all((self._uses[k] >= 2) == reused for k in queue), "a block sits in the wrong queue"
        assert self._parents.keys() <= self._uses.keys(), "parent links of untracked blocks"
        assert not any(k in self._uses for k in self._ghost), "a tracked block is also a ghost"


class DeferredAccess(EvictionPolicy):
    """A policy whose hits are recorded now and applied at its next decision.

    ``access`` only appends the keys to a log; every other call (an insert, a removal, a
    victim, a size) first replays the log into the wrapped policy, in order, so each decision
    sees exactly the state it would have seen without the wrapper. A read pays one list
    append instead of the policy's bookkeeping, which the next write (off the reader's
    critical path: demotions run on their own threads) does instead. The log is replayed
    inline once it holds ``max_pending`` keys, which bounds its memory.
    """

    name = "deferred"  # the wrapped policy's own name is ``policy.name``

    def __init__(self, policy: EvictionPolicy, max_pending: int = 16384) -> None:
        self.policy = policy
        self.max_pending = max_pending
        self._pending: list[Sequence[Key]] = []
        self._num_pending = 0

    def insert(self, keys: Sequence[Key], parents: Sequence[Key | None]) -> None:
        self.apply_pending()
        self.policy.insert(keys, parents)

    def access(self, keys: Sequence[Key]) -> None:
        """Record a hit on ``keys``; the caller must not mutate the sequence afterwards."""
        self._pending.append(keys)
        self._num_pending += len(keys)
        if self._num_pending >= self.max_pending:
            self.apply_pending()

    @property
    def num_pending(self) -> int:
        """Keys whose hits are recorded but not applied yet."""
        return self._num_pending

    def apply_pending(self) -> None:
        """Replay the recorded hits into the wrapped policy, oldest first."""
        if self._pending:
            pending, self._pending, self._num_pending = self._pending, [], 0
            for keys in pending:
                self.policy.access(keys)

    def remove(self, key: Key) -> None:
        self.apply_pending()
        self.policy.remove(key)

    def cool(self, keys: Sequence[Key]) -> None:
        self.apply_pending()
        self.policy.cool(keys)

    def pop_victim(self, can_evict: Callable[[Key], bool] | None = None) -> Key | None:
        self.apply_pending()
        return self.policy.pop_victim(can_evict)

    def peek_victim(self, can_evict: Callable[[Key], bool] | None = None) -> Key | None:
        self.apply_pending()
        return self.policy.peek_victim(can_evict)

    def __len__(self) -> int:
        self.apply_pending()
        return len(self.policy)

    def __contains__(self, key: object) -> bool:
        self.apply_pending()
        return key in self.policy

    def check_integrity(self) -> None:
        self.apply_pending()
        self.policy.check_integrity()


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "reuse": ReusePolicy}
DEFAULT_POLICY = "reuse"


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by name; raises ValueError listing the known names."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
    return factory()
