"""Who owns which key, and one pipeline per owning node, the nodes in parallel.

For a cluster the slot map comes from ``CLUSTER SLOTS`` (asked of the known nodes and the
seeds in turn); a ``MOVED`` reply fixes its slot at once and schedules a full refresh, so a
reshard or failover converges without a storm of refreshes (at most one every
``REFRESH_INTERVAL_S``, on a background thread: a request never waits for one). One server
owns every key.

The slot map is first asked for by the first call that needs it (a store opens without
waiting on the network; its first read pays the discovery, as a new engine process does once).

Each node has its own ``redis.Redis`` client (socket timeouts on connect, send and receive;
no retries: a cache's answer to a failure is a miss) and a circuit breaker. A pipeline of GETs
(``run(..., value_bytes=N)``) is sent on one of that client's connections and its replies
read by tiers.remote.replies, each value straight into memory of its own; every other
pipeline is redis-py's. ``run`` sends one pipeline per node, all nodes at once (the caller's
thread runs one, a small thread pool the others), under one deadline ``timeout_s`` after the
call began, plus its values' time at ``TRANSFER_FLOOR`` (tiers.remote.deadline): every
socket operation of the call ends by then, on every thread, so a node that stalls or trickles
its reply is a timeout for this call, charged to its breaker once, by the thread that ran its
pipeline. A pipeline the pool had not started by the deadline is cancelled: its node was
never asked, so its breaker is not charged. Workers only return what they read, never write
caller memory, so a late answer cannot land anywhere.

An ``ASK`` reply (a slot being migrated; this key already moved) is followed once, on the
same thread and deadline: ``ASKING`` plus the command on the node it names. Only ``MOVED``
changes the slot map: the slot's other keys are still on the node it names.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.connection import Connection, SSLConnection
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    MovedError,
    OutOfMemoryError,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvstore.tiers.remote.breaker import OPEN, CircuitBreaker
from kvstore.tiers.remote.deadline import DeadlineConnection, DeadlineSSLConnection, deadline, socket_of
from kvstore.tiers.remote.replies import GetReplies, Odd
from kvstore.tiers.remote.url import Node, RemoteURL

NUM_SLOTS = 16384
TRANSFER_FLOOR = 100e6  # bytes/s a node is allowed for a call's values on top of timeout_s (~1 Gbit/s)
REFRESH_INTERVAL_S = 0.25
READ_BYTES = 1 << 20  # socket reads of up to 1 MiB: a 192 KiB value in one or two recv calls
Command = tuple[Any, ...]
_DEADLINED = {Connection: DeadlineConnection, SSLConnection: DeadlineSSLConnection}  # redis-py's -> ours
# no CLIENT SETINFO on connect (newer redis-py: driver_info=None; older: lib_name and lib_version None)
_NO_SETINFO: dict[str, Any] = ({"driver_info": None} if "driver_info" in inspect.signature(redis.Redis).parameters
                               else {"lib_name": None, "lib_version": None})


class NodeUnavailable(Exception):
    """A node was not asked: its breaker is open, no node owns the slot yet, or every worker
    was busy until the call's deadline."""


def error_kind(error: BaseException) -> str:
    """The counter a failure goes to: timeout, connection, auth, cluster, oom, unavailable, other."""
    if isinstance(error, NodeUnavailable):
        return "unavailable"
    if isinstance(error, (RedisTimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(error, (AuthenticationError, AuthorizationError)):
        return "auth"
    if isinstance(error, (AskError, ClusterDownError, TryAgainError)):  # MovedError is an AskError
        return "cluster"
    if isinstance(error, OutOfMemoryError):
        return "oom"
    if isinstance(error, (RedisConnectionError, OSError)):
        return "connection"
    if isinstance(error, RedisError) and str(error).startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
        return "auth"
    return "other"


@dataclass(frozen=True)
class NodeReply:
    """What one node's pipeline gave: per command a result or an exception; or one error.
    ``followup``: the results of the second pipeline ``run(then=...)`` asked for (None when
    it asked for none or it failed: then ``error`` says why)."""

    results: list[Any] | None
    error: BaseException | None = None
    followup: list[Any] | None = None


Then = Callable[[Node, list[Any]], Sequence[Command]]


class Topology:
    """Thread-safe. Owns the per-node clients, breakers, the slot map and the worker pool."""

    def __init__(self, url: RemoteURL, timeout_s: float, *, breaker_threshold: int = 3,
                 breaker_cooldown_s: float = 0.5, max_workers: int = 8) -> None:
        self.url, self.timeout_s = url, timeout_s
        self._breaker_settings = (breaker_threshold, breaker_cooldown_s, max(5.0, breaker_cooldown_s))
        self._lock = threading.Lock()
        self._clients: dict[Node, redis.Redis] = {}
        self._breakers: dict[Node, CircuitBreaker] = {}
        self._slots: list[Node | None] = [None] * NUM_SLOTS
        self._known: list[Node] = list(url.nodes)  # seeds, then every node CLUSTER SLOTS named
        self._last_refresh = 0.0
        self._refreshing = False
        self.num_refreshes = 0
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvstore-remote")
        self._refresher = ThreadPoolExecutor(1, thread_name_prefix="kvstore-remote-slots")
        self._closed = False
        self._discovery = threading.Lock()
        self._discovered = not url.cluster  # the slot map asked for once (by the first call needing it)

    # ----------------------------------------------------------------------------- owners

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
        return sorted({n for n in self._slots if n is not None})

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
            for node in sorted(candidates, key=lambda n: self.breaker(n).state == OPEN):
                try:
                    with deadline(time.monotonic() + self.timeout_s):
                        reply = self.client(node).execute_command("CLUSTER", "SLOTS")
                except RedisError:
                    continue
                slots, named = _parse_slots(reply, node)
                if named:
                    with self._lock:
                        self._slots = slots
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

    # ----------------------------------------------------------------------------- clients

    def client(self, node: Node) -> redis.Redis:
        with self._lock:
            client = self._clients.get(node)
            if client is None:
                u = self.url
                # RESP2 and no CLIENT SETINFO: a new connection sends nothing before its first
                # command (AUTH and SELECT only where the URL asks), so a fresh store's first
                # call pays one TCP connect per node, not three more round trips
                client = redis.Redis(
                    host=node[0], port=node[1], db=u.db, username=u.username, password=u.password,
                    ssl=u.tls, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                    retry=Retry(NoBackoff(), 0), health_check_interval=0, socket_read_size=READ_BYTES,
                    protocol=2, **_NO_SETINFO,
                )
                # the same connections with their sockets under the call's deadline (no
                # connection exists yet: the pool makes them on first use)
                pool = client.connection_pool
                assert pool.connection_class in _DEADLINED, pool.connection_class
                pool.connection_class = _DEADLINED[pool.connection_class]
                self._clients[node] = client
            return client

    def breaker(self, node: Node) -> CircuitBreaker:
        with self._lock:
            found = self._breakers.get(node)
            if found is None:
                found = self._breakers[node] = CircuitBreaker(*self._breaker_settings)
            return found

    # ----------------------------------------------------------------------------- pipelines

    def run(self, batches: dict[Node, Sequence[Command]], then: Then | None = None,
            value_bytes: int | None = None, transfer_bytes: int = 0) -> dict[Node, NodeReply]:
        """One pipeline per node, nodes in parallel; returns by ``timeout_s`` after the call,
        plus the time ``transfer_bytes`` (the most one node sends or receives) take at
        ``TRANSFER_FLOOR`` bytes/s: a stalled node still costs at most that, and a large read
        is not cut off for being large.

        With ``then``, each node that answered runs a second pipeline at once, of the commands
        ``then(node, results)`` makes from its first results (a put's SETs after its EXISTS),
        without waiting for the other nodes; it shares the call's deadline. With
        ``value_bytes``, every command is a GET: each result is a ``memoryview`` of a value of
        that many bytes (memory of this call's own), ``replies.Odd`` for a value of another
        length, None for no value, or the error. Never raises for a node's failure: that
        node's reply carries the error instead.
        """
        at = time.monotonic() + self.timeout_s + transfer_bytes / TRANSFER_FLOOR
        replies: dict[Node, NodeReply] = {}
        allowed: list[Node] = []
        for node in batches:
            breaker = self.breaker(node)
            if breaker.is_closed:
                allowed.append(node)
                continue
            # Open: refuse at once. After the cool-down a PING probes the node in the
            # background, so no request ever waits on a node that is still down.
            if breaker.should_probe():
                with contextlib.suppress(RuntimeError):
                    self._pool.submit(self._probe, node)
            replies[node] = NodeReply(None, NodeUnavailable(f"{node[0]}:{node[1]} circuit open"))
        # The caller's thread runs the biggest pipeline itself (the deadline bounds it like the
        # others); the rest go to the pool, so a batch never waits on a hand-off it can avoid.
        allowed.sort(key=lambda n: len(batches[n]))
        inline = allowed.pop() if allowed else None
        asked = {node: self._pool.submit(self._pipeline, node, batches[node], then, at, value_bytes)
                 for node in allowed}
        if inline is not None:
            replies[inline] = self._pipeline(inline, batches[inline], then, at, value_bytes)
        if asked:
            wait(asked.values(), timeout=max(0.0, at - time.monotonic()))
        for node, future in asked.items():
            if future.cancel():  # never started (every worker busy): the node was not asked
                replies[node] = NodeReply(None, NodeUnavailable(f"{node[0]}:{node[1]} not asked: no worker "
                                                                f"free within {self.timeout_s} s"))
            elif future.done():
                replies[node] = future.result()
            else:  # running into its deadline now: the worker charges the node's breaker itself
                replies[node] = NodeReply(None, TimeoutError(f"{node[0]}:{node[1]} gave no reply within "
                                                             f"{self.timeout_s} s"))
        return replies

    def _probe(self, node: Node) -> None:
        breaker = self.breaker(node)
        try:
            with deadline(time.monotonic() + self.timeout_s):
                self.client(node).ping()
        except (RedisError, OSError):
            breaker.failure()
            self.invalidate()
            return
        breaker.success()

    def _pipeline(self, node: Node, commands: Sequence[Command], then: Then | None, at: float,
                  value_bytes: int | None = None) -> NodeReply:
        if time.monotonic() >= at:  # a worker freed only after the deadline: not asked, not charged
            return NodeReply(None, NodeUnavailable(f"{node[0]}:{node[1]} not asked: no worker free within "
                                                   f"{self.timeout_s} s"))
        with deadline(at):
            results = self._execute(node, commands, value_bytes)
            if isinstance(results, BaseException):
                return NodeReply(None, results)
            second = then(node, results) if then is not None else ()
            if not second:
                return NodeReply(results)
            followup = self._execute(node, second)
        if isinstance(followup, BaseException):
            return NodeReply(results, followup)
        return NodeReply(results, followup=followup)

    def _execute(self, node: Node, commands: Sequence[Command], value_bytes: int | None = None
                 ) -> list[Any] | BaseException:
        """One pipeline on ``node``, its ASK replies followed once (under the caller's deadline)."""
        results = self._send(node, commands) if value_bytes is None else self._send_gets(node, commands, value_bytes)
        if isinstance(results, BaseException):
            return results
        targets: dict[Node, list[int]] = {}
        for i, result in enumerate(results):
            if isinstance(result, AskError) and not isinstance(result, MovedError):
                targets.setdefault((result.host or node[0], int(result.port)), []).append(i)
        for target, idx in targets.items():
            if not self.breaker(target).is_closed:
                continue  # the ASK stands: a miss (or a dropped write) for those keys
            # ASKING lets the importing node serve the next command of a slot it does not own
            # yet; replies alternate: OK, the command's reply. A second redirect stays an error.
            followed = self._send(target, [c for i in idx for c in (("ASKING",), commands[i])])
            if not isinstance(followed, BaseException):
                for i, result in zip(idx, followed[1::2], strict=True):
                    results[i] = result if value_bytes is None else _as_value(result, value_bytes)
        return results

    def _send(self, node: Node, commands: Sequence[Command]) -> list[Any] | BaseException:
        breaker = self.breaker(node)
        try:
            pipe = self.client(node).pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            results = pipe.execute(raise_on_error=False)
        except (RedisError, OSError) as e:
            breaker.failure()
            self.invalidate()
            return e
        breaker.success()
        self._redirected(results)
        return list(results)

    def _send_gets(self, node: Node, commands: Sequence[Command], value_bytes: int) -> list[Any] | BaseException:
        """A pipeline of GETs, each value read into new memory of its own (never reused: a late
        reply cannot land in memory someone else reads; a value kept for later holds only
        itself; a missing one costs nothing)."""
        breaker = self.breaker(node)
        pool = self.client(node).connection_pool
        try:
            connection = pool.get_connection()
        except (RedisError, OSError) as e:
            breaker.failure()
            self.invalidate()
            return e
        try:
            connection.send_packed_command(connection.pack_commands(commands), check_health=False)
            results: list[Any] = GetReplies(socket_of(connection)).read(
                len(commands), value_bytes, lambda _i: np.empty(value_bytes, dtype=np.uint8).data)
        except BaseException as e:  # cut off halfway (a timeout too): the connection is out of step
            connection.disconnect()
            pool.release(connection)
            if not isinstance(e, (RedisError, OSError)):
                raise
            breaker.failure()
            self.invalidate()
            return e
        pool.release(connection)
        breaker.success()
        self._redirected(results)
        return results

    def _redirected(self, results: Sequence[Any]) -> None:
        for result in results:
            if isinstance(result, MovedError):  # the slot lives elsewhere now
                self.moved(result)
            elif isinstance(result, (ClusterDownError, TryAgainError)):
                self.invalidate()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients = list(self._clients.values())
        self._refresher.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in clients:
            with contextlib.suppress(RedisError):
                client.close()


def _as_value(result: Any, value_bytes: int) -> Any:
    """A reply redis-py read (an ASK followed) in the form ``run(value_bytes=...)`` gives."""
    if isinstance(result, (bytes, bytearray)):
        view = memoryview(result)
        return view if len(view) == value_bytes else Odd(view, len(view))
    return result


def _parse_slots(reply: Any, asked: Node) -> tuple[list[Node | None], list[Node]]:
    """CLUSTER SLOTS -> (owner per slot, every node named). Empty host means the asked one."""
    slots: list[Node | None] = [None] * NUM_SLOTS
    named: list[Node] = []
    for entry in reply or ():
        start, end, primary, *replicas = entry
        nodes = []
        for item in (primary, *replicas):
            host = item[0].decode() if isinstance(item[0], bytes) else str(item[0])
            nodes.append((host or asked[0], int(item[1])))
        named += nodes
        slots[int(start) : int(end) + 1] = [nodes[0]] * (int(end) - int(start) + 1)
    return slots, named
