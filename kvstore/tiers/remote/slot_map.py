"""Who owns which key: the cluster's slot map (slot -> primary, and each primary's replicas),
kept fresh from the replies.

For a cluster the slot map comes from ``CLUSTER SLOTS`` (asked of the known nodes and the
seeds in turn); a ``MOVED`` reply fixes its slot at once and schedules a full refresh, so a
reshard or failover converges without a storm of refreshes (at most one every
``REFRESH_INTERVAL_S``, on a background thread: a request never waits for one). One server
owns every key.

The slot map is first asked for by the first call that needs it (a store opens without
waiting on the network; its first read pays the discovery, as a new engine process does once).

Only ``MOVED`` changes the map. An ``ASK`` reply (a slot being migrated; this key already
moved) is the pipelines' to follow (tiers.remote.topology): the slot's other keys are still
on the node the map names.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from redis.crc import key_slot
from redis.exceptions import ClusterDownError, MovedError, RedisError, TryAgainError

from kvstore.tiers.remote.breaker import OPEN
from kvstore.tiers.remote.deadline import deadline
from kvstore.tiers.remote.nodes import NodeClients
from kvstore.tiers.remote.replies import UNREADABLE
from kvstore.tiers.remote.url import Node, RemoteURL

NUM_SLOTS = 16384
REFRESH_INTERVAL_S = 0.25


class SlotMap:
    """Thread-safe. Owns the slot map, the nodes known to ask for it, and the refresh thread.

    Args:
        url: the seeds (and whether they are a cluster at all).
        nodes: the per-node clients and breakers ``CLUSTER SLOTS`` is asked through.
        timeout_s: the deadline of one ``CLUSTER SLOTS``.
    """

    def __init__(self, url: RemoteURL, nodes: NodeClients, timeout_s: float) -> None:
        self.url, self.timeout_s = url, timeout_s
        self._nodes = nodes
        self._lock = threading.Lock()
        self._slots: list[Node | None] = [None] * NUM_SLOTS
        self._replicas: dict[Node, tuple[Node, ...]] = {}  # primary -> its replicas, as CLUSTER SLOTS names them
        self._known: list[Node] = list(url.nodes)  # seeds, then every node CLUSTER SLOTS named
        self._last_refresh = 0.0
        self._refreshing = False
        self.num_refreshes = 0
        self._refresher = ThreadPoolExecutor(1, thread_name_prefix="kvstore-remote-slots")
        self._closed = False
        self._discovery = threading.Lock()
        self._discovered = not url.cluster  # the slot map asked for once (by the first call needing it)

    def owner(self, name: bytes) -> Node | None:
        """The primary that owns ``name`` now, or None when no node is known to."""
        if not self.url.cluster:
            return self.url.nodes[0]
        if not self._discovered:
            self.discover()
        node = self._slots[key_slot(name)]
        if node is None:
            self.invalidate()
        return node

    def primaries(self) -> list[Node]:
        """The primaries the slot map names (the one server without a cluster)."""
        if not self.url.cluster:
            return [self.url.nodes[0]]
        if not self._discovered:
            self.discover()
        return self._owners()

    def replicas(self, primary: Node) -> tuple[Node, ...]:
        """The replicas the last ``CLUSTER SLOTS`` named for ``primary`` (none without a cluster)."""
        return self._replicas.get(primary, ())

    def discover(self) -> None:
        """Ask for the slot map now, once (callers meanwhile wait for this one). Best effort:
        with no node up every key stays unowned, and later calls refresh in the background."""
        with self._discovery:
            if not self._discovered:
                self._refresh()
                self._discovered = True

    def _owners(self) -> list[Node]:
        return sorted({n for n in self._slots if n is not None})

    def invalidate(self) -> None:
        """Ask for a slot map refresh (at most one every REFRESH_INTERVAL_S, in the background)."""
        if not self.url.cluster:
            return
        with self._lock:
            if self._closed or self._refreshing or time.monotonic() - self._last_refresh < REFRESH_INTERVAL_S:
                return
            self._refreshing = True
        with contextlib.suppress(RuntimeError):  # shut down meanwhile
            self._refresher.submit(self._refresh)

    def _refresh(self) -> None:
        try:
            with self._lock:
                candidates = list(dict.fromkeys(self._owners() + self._known))
            for node in sorted(candidates, key=lambda n: self._nodes.breaker(n).state == OPEN):
                try:
                    with deadline(time.monotonic() + self.timeout_s):
                        reply = self._nodes.client(node).execute_command("CLUSTER", "SLOTS")
                    slots, named = parse_slots(reply, node)
                except (RedisError, *UNREADABLE):  # no answer, or one no Redis gives: ask the next node
                    continue
                if named:
                    with self._lock:
                        self._slots = slots
                        self._replicas = parse_replicas(reply, node)
                        self._known = list(dict.fromkeys(self._known + named))
                        self.num_refreshes += 1
                    return
        finally:
            with self._lock:
                self._last_refresh, self._refreshing = time.monotonic(), False

    def moved(self, error: MovedError) -> None:
        """A MOVED reply names the slot's new owner: use it now, refresh the rest later."""
        if self.url.cluster and 0 <= error.slot_id < NUM_SLOTS:
            self._slots[error.slot_id] = (error.host, int(error.port))
        self.invalidate()

    def redirected(self, results: Sequence[Any]) -> None:
        """Learn from a pipeline's results: a MOVED fixes its slot, a cluster that is down or
        busy resharding asks for a refresh."""
        for result in results:
            if isinstance(result, MovedError):  # the slot lives elsewhere now
                self.moved(result)
            elif isinstance(result, (ClusterDownError, TryAgainError)):
                self.invalidate()

    def close(self) -> None:
        """No refresh after this one; a refresh under way ends on its own deadline."""
        with self._lock:
            self._closed = True
        self._refresher.shutdown(wait=False, cancel_futures=True)


def parse_slots(reply: Any, asked: Node) -> tuple[list[Node | None], list[Node]]:
    """CLUSTER SLOTS -> (owner per slot, every node named). Empty host means the asked one."""
    slots: list[Node | None] = [None] * NUM_SLOTS
    named: list[Node] = []
    for start, end, nodes in _ranges(reply, asked):
        named += nodes
        slots[start : end + 1] = [nodes[0]] * (end - start + 1)
    return slots, named


def parse_replicas(reply: Any, asked: Node) -> dict[Node, tuple[Node, ...]]:
    """CLUSTER SLOTS -> the replicas named for each primary (over all its slot ranges)."""
    replicas: dict[Node, dict[Node, None]] = {}
    for _start, _end, (primary, *others) in _ranges(reply, asked):
        replicas.setdefault(primary, {}).update(dict.fromkeys(others))
    return {primary: tuple(found) for primary, found in replicas.items()}


def _ranges(reply: Any, asked: Node) -> list[tuple[int, int, list[Node]]]:
    """CLUSTER SLOTS -> (first slot, last slot, [primary, *replicas]) per range.

    Raises:
        ValueError: a reply no Redis gives (another shape, slots outside 0..16383, a port
            outside 1..65535, a host that is not UTF-8), naming the entry.
    """
    if reply is not None and not isinstance(reply, list):
        raise ValueError(f"CLUSTER SLOTS answered {type(reply).__name__} {reply!r:.60}, not an array")
    out = []
    for i, entry in enumerate(reply or ()):
        if not (isinstance(entry, list) and len(entry) >= 3 and all(_is_int(x) for x in entry[:2])
                and all(isinstance(n, list) and len(n) >= 2 and isinstance(n[0], bytes | str) and _is_int(n[1])
                        for n in entry[2:])):
            raise ValueError(f"CLUSTER SLOTS entry #{i} is not [start, end, [host, port, ...], ...]: {entry!r:.120}")
        start, end = entry[:2]
        if not 0 <= start <= end < NUM_SLOTS:
            raise ValueError(f"CLUSTER SLOTS entry #{i} has slots {start}..{end}, not within 0..{NUM_SLOTS - 1}")
        nodes = []
        for host, port, *_ in entry[2:]:
            if not 0 < port < 65536:
                raise ValueError(f"CLUSTER SLOTS entry #{i} names port {port}")
            try:
                host = host.decode() if isinstance(host, bytes) else host
            except UnicodeDecodeError:
                raise ValueError(f"CLUSTER SLOTS entry #{i} names host {host!r:.60}, not UTF-8") from None
            nodes.append((host or asked[0], port))
        out.append((start, end, nodes))
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
