"""LookupCounts: hits and misses per tier (and per tenant) of every lookup, counted under the lock.

A lookup does not wait for the store lock (another thread's put may hold it through a large
copy): it notes what it found (``count_later``: one atomic append) and the next holder of the
lock that counts or reads the counters counts it (``settle``). Gets count under the lock they
hold anyway (``count``).

A lookup that found the leading run ``tiers`` (each block's best tier) of ``num_keys`` keys:
a level hits the blocks it is the best holder of, and misses those found only below it, plus
one for a run that ends short.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvstore.store.levels.base import Level


class LookupCounts:
    def __init__(self, levels: Sequence[Level]) -> None:
        self.levels = levels
        self._uncounted: deque[tuple[Sequence[str], int, str | None]] = deque()

    def count(self, tiers: Sequence[str], num_keys: int, tenant: str | None = None) -> None:
        """Count a lookup (store lock held); with ``tenant`` (``BlockIndex.chain_tenant``), in
        that tenant's counters of each level too."""
        if self._uncounted:
            self.settle()
        self._count(tiers, num_keys, tenant)

    def count_later(self, tiers: Sequence[str], num_keys: int, tenant: str | None = None) -> None:
        """``count`` for a lookup made without the lock: noted now, counted by ``settle``."""
        self._uncounted.append((tiers, num_keys, tenant))

    @property
    def num_uncounted(self) -> int:
        """Lookups noted by ``count_later`` and not counted yet."""
        return len(self._uncounted)

    def settle(self) -> None:
        """Count the lookups noted by ``count_later`` (store lock held)."""
        uncounted = self._uncounted
        while uncounted:
            self._count(*uncounted.popleft())

    def _count(self, tiers: Sequence[str], num_keys: int, tenant: str | None = None) -> None:
        short = 1 if len(tiers) < num_keys else 0
        below = len(tiers)
        for level in self.levels:
            hits = tiers.count(level.name)
            below -= hits
            level.counters.hits += hits
            level.counters.misses += below + short
            if tenant is not None and level.tenants is not None:
                row = level.tenants.counters.row(tenant)
                row.hits += hits
                row.misses += below + short
