"""RoutingHistory: where the router itself sent each prefix, as guesses in the index.

Two uses of one record:

- **Pending guesses.** A request's blocks reach a replica's events only after its prefill; a
  second turn sent meanwhile must still go to the same place. Every routed chain sets the
  index's ``ROUTED`` bit for that replica; it expires after ``pending_ttl_s``.
- **Approximate mode.** While a replica's events are stale (no heartbeat), its guesses do not
  expire: the router routes it from its own history (SGLang's approximate tree, as a set of
  block ids), up to about ``capacity_blocks`` per replica, oldest forgotten first.

Guesses live in two generations, so that recording costs one vectorised index update and no
per-block bookkeeping: a route sets the current generation's bit; every ``pending_ttl_s / 2``
the generations turn (the old one is dropped, the current one becomes old, one column pass).
A guess thus lives between half the TTL and the TTL after its last routing. In approximate
mode the generations turn only when the replica's guesses exceed ``capacity_blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstore.services.router.policy.index import PrefixIndex


@dataclass
class _Generations:
    started: float  # when the current generation began
    num_current: int = 0  # guesses new in the current generation
    num_old: int = 0  # guesses in the previous one


class RoutingHistory:
    """The router's record of routed block ids; it owns every ``ROUTED`` bit of ``index``."""

    def __init__(self, index: PrefixIndex, pending_ttl_s: float, capacity_blocks: int) -> None:
        self._index = index
        self.pending_ttl_s = pending_ttl_s
        self.capacity_blocks = capacity_blocks
        self._replicas: dict[str, _Generations] = {}
        self._approximate: set[str] = set()

    def is_approximate(self, replica: str) -> bool:
        return replica in self._approximate

    def record(self, replica: str, ids: np.ndarray, now: float) -> None:
        """``ids`` (a chain) were just routed to ``replica``."""
        gens = self._replicas.get(replica)
        if gens is None:
            gens = self._replicas[replica] = _Generations(now)
        gens.num_current += self._index.routed(replica, ids)
        if replica in self._approximate and gens.num_current + gens.num_old > self.capacity_blocks:
            self._turn(replica, gens, now)

    def expire(self, now: float) -> None:
        """Turn the generations of every replica not in approximate mode that is due."""
        half = self.pending_ttl_s / 2
        for replica, gens in self._replicas.items():
            if replica in self._approximate or now - gens.started < half:
                continue
            if now - gens.started >= self.pending_ttl_s:  # idle for a whole TTL: both go
                self._index.clear_routed(replica)
                gens.started, gens.num_current, gens.num_old = now, 0, 0
            else:
                self._turn(replica, gens, now)

    def _turn(self, replica: str, gens: _Generations, now: float) -> None:
        gens.num_old = self._index.age_routed(replica)
        gens.started, gens.num_current = now, 0

    def set_approximate(self, replica: str, approximate: bool, now: float) -> None:
        """Enter (keep every guess) or leave (guesses expire again) approximate mode."""
        if approximate:
            self._approximate.add(replica)
        else:
            self._approximate.discard(replica)
            self.expire(now)

    def forget(self, replica: str) -> None:
        """Drop every guess for ``replica`` (it died, restarted or was removed)."""
        self._approximate.discard(replica)
        if self._replicas.pop(replica, None) is not None and replica in self._index.replicas:
            self._index.clear_routed(replica)

    def num_guesses(self, replica: str) -> int:
        """About how many guesses ``replica`` has (without a scan)."""
        gens = self._replicas.get(replica)
        return 0 if gens is None else gens.num_current + gens.num_old
