"""HostReservations: free host slots handed out ahead of the blocks that will fill them.

A read reserves host slots for the promotions it copies outside the lock; the daemon reserves
them for a shared-memory writer (a write lease) or a socket put received straight into the
pool; a write-through put keeps its host slots reserved until its disk write settles. A
reserved slot is neither free nor any block's: no lookup sees it until ``publish`` makes its
block visible, and slots never published go back with ``end``.

Every method expects the store lock held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.errors import CapacityError
from kvstore.store.levels.host_level import HostLevel


class HostReservations:
    """Host slots reserved and not yet published, over one store's host level.

    Args:
        host: host RAM's level.
        make_room: ``make_room(n)``: the cascade's demotion of up to ``n`` host blocks.
    """

    def __init__(self, host: HostLevel, make_room: Callable[[int], None]) -> None:
        self.host = host
        self._make_room = make_room
        self.num_reserved = 0

    def reserve(self, n: int) -> list[int]:
        """Make room for and take up to ``n`` free host slots (fewer when the rest is pinned or
        being read)."""
        host = self.host
        if host.num_free < n:
            self._make_room(n - host.num_free)
        slots = host.allocate(min(n, host.num_free))
        self.num_reserved += len(slots)
        return slots

    def reserve_exactly(self, n: int, evict: bool = True) -> list[int]:
        """``reserve`` for a writer that needs all ``n`` slots or none; with ``evict=False``
        only from slots already free (a reservation ahead of need).

        Raises:
            CapacityError: fewer than ``n`` slots can be freed (the rest pinned or in flight).
        """
        host = self.host
        if n > host.num_slots - self.num_reserved:  # hopeless: evict nothing
            raise CapacityError(f"need {n} host slots, {host.num_slots} in the pool, "
                                f"{self.num_reserved} of them reserved")
        if host.num_free < n and evict:
            self._make_room(n - host.num_free)
        if host.num_free < n:
            raise CapacityError(f"need {n} host slots, {host.num_free} free of "
                                f"{host.num_slots} (the rest pinned or being read)")
        return self.reserve(n)

    def keep(self, n: int) -> None:
        """``n`` host slots the caller took itself are reserved from now on (a write-through
        put's, until its disk write settles)."""
        self.num_reserved += n

    def end(self, num_reserved: int, unused: Sequence[int]) -> None:
        """``num_reserved`` reserved slots are done with: those published hold blocks now, and
        ``unused`` (never published) go back to the free pool."""
        self.num_reserved -= num_reserved
        assert self.num_reserved >= 0, "more host slots given back than reserved"
        if unused:
            self.host.release(unused)
