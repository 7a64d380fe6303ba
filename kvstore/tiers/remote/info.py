"""Occupancy of the remote tier, read from the primaries' INFO (cached for a second).

Redis decides what stays (``maxmemory`` + its eviction policy), so capacity, use and evictions
are the nodes' own numbers: ``maxmemory``, ``used_memory``, ``evicted_keys``, and ``DBSIZE``
for the block count (every key of database 0; the cluster is assumed to be kvstore's).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from kvstore.tiers.remote.topology import Topology

CACHE_S = 1.0


@dataclass(frozen=True)
class NodeInfo:
    """One primary as INFO saw it; ``up`` False (and zeros) when it did not answer."""

    address: str
    up: bool
    breaker: str
    used_memory: int = 0
    maxmemory: int = 0
    evicted_keys: int = 0
    keys: int = 0
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"address": self.address, "up": self.up, "breaker": self.breaker,
                "used_memory": self.used_memory, "maxmemory": self.maxmemory,
                "evicted_keys": self.evicted_keys, "keys": self.keys, "error": self.error}


class NodeInfoCache:
    """``nodes()`` asks every primary at most once per CACHE_S; never raises."""

    def __init__(self, topology: Topology) -> None:
        self._topology = topology
        self._lock = threading.Lock()
        self._at = float("-inf")
        self._nodes: list[NodeInfo] = []

    def nodes(self) -> list[NodeInfo]:
        with self._lock:
            if time.monotonic() - self._at < CACHE_S:
                return self._nodes
        primaries = self._topology.primaries()
        replies = self._topology.run({n: [("INFO", "memory"), ("INFO", "stats"), ("DBSIZE",)] for n in primaries})
        found: list[NodeInfo] = []
        for node in primaries:
            reply = replies[node]
            address, breaker = f"{node[0]}:{node[1]}", self._topology.breaker(node).state
            results = reply.results
            if results is None or any(isinstance(r, BaseException) for r in results):
                error = reply.error or next(r for r in results or () if isinstance(r, BaseException))
                found.append(NodeInfo(address, False, breaker, error=type(error).__name__))
                continue
            memory, stats, dbsize = results
            try:
                found.append(NodeInfo(address, True, breaker, int(memory.get("used_memory", 0)),
                                      int(memory.get("maxmemory", 0)), int(stats.get("evicted_keys", 0)),
                                      int(dbsize)))
            except (TypeError, ValueError, OverflowError) as exc:  # a field no Redis sends ("used_memory:x")
                found.append(NodeInfo(address, False, breaker, error=f"unreadable INFO or DBSIZE: {exc}"[:120]))
        with self._lock:
            self._nodes, self._at = found, time.monotonic()
        return found
