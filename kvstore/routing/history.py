"""RoutingHistory: where the router itself sent each prefix, as guesses in the index.

Two uses of one record (per replica, block id -> when it was last routed there):

- **Pending guesses.** A request's blocks reach a replica's events only after its prefill; a
  second turn sent meanwhile must still go to the same place. Every routed chain sets the
  index's ``ROUTED`` bit for that replica; it expires after ``pending_ttl_s``.
- **Approximate mode.** While a replica's events are stale (no heartbeat), its guesses do not
  expire: the router routes it from its own history (SGLang's approximate tree, as a set of
  block ids), up to ``capacity_blocks`` per replica, oldest forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvstore.routing.index import PrefixIndex


class RoutingHistory:
    """The router's record of routed block ids; it owns every ``ROUTED`` bit of ``index``."""

    def __init__(self, index: PrefixIndex, pending_ttl_s: float, capacity_blocks: int) -> None:
        self._index = index
        self.pending_ttl_s = pending_ttl_s
        self.capacity_blocks = capacity_blocks
        self._routed: dict[str, OrderedDict[int, float]] = {}  # oldest first
        self._approximate: set[str] = set()

    def is_approximate(self, replica: str) -> bool:
        return replica in self._approximate

    def record(self, replica: str, ids: np.ndarray, now: float) -> None:
        """``ids`` (a chain) were just routed to ``replica``."""
        routed = self._routed.setdefault(replica, OrderedDict())
        new = []
        for block in ids.tolist():
            if block in routed:
                routed.move_to_end(block)
            else:
                new.append(block)
            routed[block] = now
        if new:
            self._index.routed(replica, np.array(new, dtype=np.uint64))
        overflow = len(routed) - self.capacity_blocks
        if overflow > 0:
            self._drop(replica, [routed.popitem(last=False)[0] for _ in range(overflow)])

    def expire(self, now: float) -> None:
        """Drop guesses older than the TTL on every replica not in approximate mode."""
        horizon = now - self.pending_ttl_s
        for replica, routed in self._routed.items():
            if replica in self._approximate or not routed:
                continue
            old = []
            while routed and next(iter(routed.values())) < horizon:
                old.append(routed.popitem(last=False)[0])
            self._drop(replica, old)

    def set_approximate(self, replica: str, approximate: bool, now: float) -> None:
        """Enter (keep every guess) or leave (guesses expire again) approximate mode."""
        if approximate:
            self._approximate.add(replica)
        else:
            self._approximate.discard(replica)
            self.expire(now)

    def forget(self, replica: str) -> None:
        """Drop every guess for ``replica`` (it died, restarted or was removed)."""
        routed = self._routed.pop(replica, None)
        self._approximate.discard(replica)
        if routed and replica in self._index.replicas:
            self._index.unrouted(replica, np.fromiter(routed, dtype=np.uint64, count=len(routed)))

    def num_guesses(self, replica: str) -> int:
        return len(self._routed.get(replica, ()))

    def _drop(self, replica: str, ids: list[int]) -> None:
        if ids:
            self._index.unrouted(replica, np.array(ids, dtype=np.uint64))
