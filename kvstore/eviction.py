"""Eviction policies: strategy objects that order one tier's blocks for eviction.

A policy holds keys only, never bytes or slots; the tier holds the bytes and ``TieredStore``
decides what happens to a victim (demote or drop). The same objects drive ``kvstore replay``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
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
    def pop_victim(self, can_evict: Callable[[Key], bool] | None = None) -> Key | None:
        """Remove and return the next block to evict.

        Args:
            can_evict: a predicate; blocks for which it is False (pinned, in flight) are
                skipped and stay tracked.

        Returns:
            The victim's key, or None when no tracked block may be evicted.
        """

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...


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

    def pop_victim(self, can_evict: Callable[[Key], bool] | None = None) -> Key | None:
        for key in self._order:
            if can_evict is None or can_evict(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy}
DEFAULT_POLICY = "lru"


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by name; raises ValueError listing the known names."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
    return factory()
