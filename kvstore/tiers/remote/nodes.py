"""The remote tier's nodes as the slot map and the pipelines both see them: one ``redis.Redis``
client and one circuit breaker per node, and the small types of a call's outcome.

This module is the bottom of the tier's topology: ``slot_map`` (who owns which key) and
``topology`` (one pipeline per owning node) import it, and it imports neither.

Each node's client has socket timeouts on connect, send and receive and no retries (a cache's
answer to a failure is a miss); its connections are the deadline-aware ones of
tiers.remote.deadline, so every socket operation of a call ends by that call's deadline. A
replica has a second client whose connections send ``READONLY`` when they connect: reads of
its primary's slots, while that primary is down (tiers.remote.topology).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.connection import Connection, SSLConnection
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    OutOfMemoryError,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvstore.tiers.remote.breaker import CircuitBreaker
from kvstore.tiers.remote.deadline import DeadlineConnection, DeadlineSSLConnection
from kvstore.tiers.remote.url import Node, RemoteURL

READ_BYTES = 1 << 20  # socket reads of up to 1 MiB: a 192 KiB value in one or two recv calls
Command = tuple[Any, ...]
# The commands of a second pipeline a node runs at once, made from its first pipeline's results
# (``Topology.run(then=...)``: a put's SETs after its EXISTS).
Then = Callable[[Node, list[Any]], Sequence[Command]]
_DEADLINED = {Connection: DeadlineConnection, SSLConnection: DeadlineSSLConnection}  # redis-py's -> ours
# no CLIENT SETINFO on connect (newer redis-py: driver_info=None; older: lib_name and lib_version None)
_NO_SETINFO: dict[str, Any] = ({"driver_info": None} if "driver_info" in inspect.signature(redis.Redis).parameters
                               else {"lib_name": None, "lib_version": None})


def _read_only(connection: Connection) -> None:
    """Connect as redis-py does, then ``READONLY``: this connection may read its node's
    primary's slots (a replica serves them; a primary ignores it)."""
    connection.on_connect()
    connection.send_command("READONLY")
    reply = connection.read_response()
    if reply not in (b"OK", "OK"):
        raise RedisConnectionError(f"READONLY answered {reply!r}")


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
    it asked for none or it failed: then ``error`` says why). ``failed_over``: the results
    are a replica's, read because the primary failed with this error."""

    results: list[Any] | None
    error: BaseException | None = None
    followup: list[Any] | None = None
    failed_over: BaseException | None = None  # the primary's failure a replica then answered for


class NodeClients:
    """Thread-safe. Owns one client and one circuit breaker per node, each made on first use."""

    def __init__(self, url: RemoteURL, timeout_s: float, *, breaker_threshold: int = 3,
                 breaker_cooldown_s: float = 0.5) -> None:
        self.url, self.timeout_s = url, timeout_s
        self._breaker_settings = (breaker_threshold, breaker_cooldown_s, max(5.0, breaker_cooldown_s))
        self._lock = threading.Lock()
        self._clients: dict[tuple[Node, bool], redis.Redis] = {}
        self._breakers: dict[Node, CircuitBreaker] = {}

    def client(self, node: Node, *, read_only: bool = False) -> redis.Redis:
        """``node``'s client; ``read_only``: the one whose connections send ``READONLY``."""
        with self._lock:
            client = self._clients.get((node, read_only))
            if client is None:
                u = self.url
                # RESP2 and no CLIENT SETINFO: a new connection sends nothing before its first
                # command (AUTH and SELECT only where the URL asks), so a fresh store's first
                # call pays one TCP connect per node, not three more round trips
                # redis-py calls redis_connect_func with the connection (its hint says no argument)
                on_connect: Any = _read_only if read_only else None
                client = redis.Redis(
                    host=node[0], port=node[1], db=u.db, username=u.username, password=u.password,
                    ssl=u.tls, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                    retry=Retry(NoBackoff(), 0), health_check_interval=0, socket_read_size=READ_BYTES,
                    protocol=2, redis_connect_func=on_connect, **_NO_SETINFO,
                )
                # the same connections with their sockets under the call's deadline (no
                # connection exists yet: the pool makes them on first use)
                pool = client.connection_pool
                assert pool.connection_class in _DEADLINED, pool.connection_class
                pool.connection_class = _DEADLINED[pool.connection_class]
                self._clients[(node, read_only)] = client
            return client

    def breaker(self, node: Node) -> CircuitBreaker:
        with self._lock:
            found = self._breakers.get(node)
            if found is None:
                found = self._breakers[node] = CircuitBreaker(*self._breaker_settings)
            return found

    def close(self) -> None:
        """Close every client (a client asked for afterwards is a new one)."""
        with self._lock:
            clients = list(self._clients.values())
        for client in clients:
            with contextlib.suppress(RedisError):
                client.close()
