"""One pipeline per owning node, the nodes in parallel, under one deadline.

``Topology`` is the remote tier's view of its nodes: who owns a key is its slot map's
(tiers.remote.slot_map), each node's client and breaker are tiers.remote.nodes'; this module
sends the commands.

A pipeline of GETs (``run(..., value_bytes=N)``) is sent on one of the node's client's
connections and its replies read by tiers.remote.replies, each value straight into memory of
its own; every other pipeline is redis-py's. ``run`` sends one pipeline per node, all nodes at
once (the caller's thread runs one, a small thread pool the others), under one deadline
``timeout_s`` after the call began, plus its values' time at ``TRANSFER_FLOOR``
(tiers.remote.deadline): every socket operation of the call ends by then, on every thread, so a
node that stalls or trickles its reply is a timeout for this call, charged to its breaker once,
by the thread that ran its pipeline. A pipeline the pool had not started by the deadline is
cancelled: its node was never asked, so its breaker is not charged. Workers only return what
they read, never write caller memory, so a late answer cannot land anywhere.

An ``ASK`` reply (a slot being migrated; this key already moved) is followed once, on the
same thread and deadline: ``ASKING`` plus the command on the node it names. Only ``MOVED``
changes the slot map.

Reads (``run(..., replica_reads=True)``: GET, EXISTS) of a primary that fails, or whose
breaker is open, go to one of its replicas on a ``READONLY`` connection, on the same thread
and deadline, until the cluster promotes one and the slot map names it. A replica may lack a
value or hold an older one: the value's own checks make that a miss (tiers.remote.codec),
never other bytes. Writes never go to a replica: those of a down primary are dropped.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import redis
from redis.exceptions import AskError, MovedError, RedisError

from kvstore.tiers.remote.breaker import CircuitBreaker
from kvstore.tiers.remote.deadline import current_deadline, deadline, socket_of
from kvstore.tiers.remote.nodes import Command, NodeClients, NodeReply, NodeUnavailable, Then
from kvstore.tiers.remote.replies import UNREADABLE, GetReplies, Odd, ProtocolError
from kvstore.tiers.remote.slot_map import SlotMap
from kvstore.tiers.remote.url import Node, RemoteURL

TRANSFER_FLOOR = 100e6  # bytes/s a node is allowed for a call's values on top of timeout_s (~1 Gbit/s)


class Topology:
    """Thread-safe. Owns the node clients, the slot map and the worker pool."""

    def __init__(self, url: RemoteURL, timeout_s: float, *, breaker_threshold: int = 3,
                 breaker_cooldown_s: float = 0.5, max_workers: int = 8) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.nodes = NodeClients(url, timeout_s, breaker_threshold=breaker_threshold,
                                 breaker_cooldown_s=breaker_cooldown_s)
        self.slots = SlotMap(url, self.nodes, timeout_s)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvstore-remote")

    def owner(self, name: bytes) -> Node | None:
        """The primary that owns ``name`` now, or None when no node is known to."""
        return self.slots.owner(name)

    def primaries(self) -> list[Node]:
        """The primaries the slot map names (the one server without a cluster)."""
        return self.slots.primaries()

    def client(self, node: Node) -> redis.Redis:
        return self.nodes.client(node)

    def breaker(self, node: Node) -> CircuitBreaker:
        return self.nodes.breaker(node)

    def run(self, batches: dict[Node, Sequence[Command]], then: Then | None = None,
            value_bytes: int | None = None, transfer_bytes: int = 0, *,
            replica_reads: bool = False) -> dict[Node, NodeReply]:
        """One pipeline per node, nodes in parallel; returns by ``timeout_s`` after the call,
        plus the time ``transfer_bytes`` (the most one node sends or receives) take at
        ``TRANSFER_FLOOR`` bytes/s: a stalled node still costs at most that, and a large read
        is not cut off for being large.

        With ``then``, each node that answered runs a second pipeline at once, of the commands
        ``then(node, results)`` makes from its first results (a put's SETs after its EXISTS),
        without waiting for the other nodes; it shares the call's deadline. With
        ``value_bytes``, every command is a GET: each result is a ``memoryview`` of a value of
        that many bytes (memory of this call's own), ``replies.Odd`` for a value of another
        length, None for no value, or the error. ``replica_reads``: the commands only read,
        and a replica answers for a primary that fails or whose breaker is open
        (``NodeReply.failed_over``). Never raises for a node's failure: that node's reply
        carries the error instead.
        """
        at = time.monotonic() + self.timeout_s + transfer_bytes / TRANSFER_FLOOR
        outer = current_deadline()  # a call inside a caller's (a read's DEL of bad values) ends by its deadline
        at = at if outer is None else min(at, outer)
        replies: dict[Node, NodeReply] = {}
        allowed: list[Node] = []
        for node in batches:
            breaker = self.breaker(node)
            if breaker.is_closed:
                allowed.append(node)
                continue
            # Open: refuse at once (or read its replica). After the cool-down a PING probes
            # the node in the background, so no request ever waits on a node that is still down.
            if breaker.should_probe():
                with contextlib.suppress(RuntimeError):
                    self._pool.submit(self._probe, node)
            if replica_reads and self._replica(node) is not None:
                allowed.append(node)
                continue
            replies[node] = NodeReply(None, NodeUnavailable(f"{node[0]}:{node[1]} circuit open"))
        # The caller's thread runs the biggest pipeline itself (the deadline bounds it like the
        # others); the rest go to the pool, so a batch never waits on a hand-off it can avoid.
        allowed.sort(key=lambda n: len(batches[n]))
        inline = allowed.pop() if allowed else None
        asked = {node: self._pool.submit(self._pipeline, node, batches[node], then, at, value_bytes, replica_reads)
                 for node in allowed}
        if inline is not None:
            replies[inline] = self._pipeline(inline, batches[inline], then, at, value_bytes, replica_reads)
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
        except (RedisError, OSError, *UNREADABLE):  # (else the breaker stays half-open, probing, for good)
            breaker.failure()
            self.slots.invalidate()
            return
        breaker.success()

    def _replica(self, primary: Node) -> Node | None:
        """A replica of ``primary`` whose breaker is closed, if the slot map names one."""
        return next((r for r in self.slots.replicas(primary) if self.breaker(r).is_closed), None)

    def _pipeline(self, node: Node, commands: Sequence[Command], then: Then | None, at: float,
                  value_bytes: int | None = None, replica_reads: bool = False) -> NodeReply:
        if time.monotonic() >= at:  # a worker freed only after the deadline: not asked, not charged
            return NodeReply(None, NodeUnavailable(f"{node[0]}:{node[1]} not asked: no worker free within "
                                                   f"{self.timeout_s} s"))
        with deadline(at):
            if self.breaker(node).is_closed:
                results = self._execute(node, commands, value_bytes)
            else:
                results = NodeUnavailable(f"{node[0]}:{node[1]} circuit open")
            if isinstance(results, BaseException) and replica_reads:
                replica = self._replica(node)
                read = self._execute(replica, commands, value_bytes, read_only=True) if replica else results
                if not isinstance(read, BaseException):
                    return NodeReply(read, failed_over=results)
            if isinstance(results, BaseException):
                return NodeReply(None, results)
            second = then(node, results) if then is not None else ()
            if not second:
                return NodeReply(results)
            followup = self._execute(node, second)
        if isinstance(followup, BaseException):
            return NodeReply(results, followup)
        return NodeReply(results, followup=followup)

    def _execute(self, node: Node, commands: Sequence[Command], value_bytes: int | None = None,
                 read_only: bool = False) -> list[Any] | BaseException:
        """One pipeline on ``node``, its ASK replies followed once (under the caller's deadline);
        ``read_only``: on a READONLY connection (a replica answering for its primary)."""
        results = (self._send(node, commands, read_only) if value_bytes is None
                   else self._send_gets(node, commands, value_bytes, read_only))
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

    def _send(self, node: Node, commands: Sequence[Command], read_only: bool = False) -> list[Any] | BaseException:
        breaker = self.breaker(node)
        try:
            pipe = self.nodes.client(node, read_only=read_only).pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            results = pipe.execute(raise_on_error=False)
        except (RedisError, OSError, *UNREADABLE) as e:
            breaker.failure()
            self.slots.invalidate()
            return e if isinstance(e, (RedisError, OSError)) else _unreadable(node, e)
        breaker.success()
        self.slots.redirected(results)
        return list(results)

    def _send_gets(self, node: Node, commands: Sequence[Command], value_bytes: int,
                   read_only: bool = False) -> list[Any] | BaseException:
        """A pipeline of GETs, each value read into new memory of its own (never reused: a late
        reply cannot land in memory someone else reads; a value kept for later holds only
        itself; a missing one costs nothing)."""
        breaker = self.breaker(node)
        pool = self.nodes.client(node, read_only=read_only).connection_pool
        try:
            connection = pool.get_connection()
        except (RedisError, OSError, *UNREADABLE) as e:  # (connecting may read a reply: READONLY's)
            breaker.failure()
            self.slots.invalidate()
            return e if isinstance(e, (RedisError, OSError)) else _unreadable(node, e)
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
            self.slots.invalidate()
            return e
        pool.release(connection)
        breaker.success()
        self.slots.redirected(results)
        return results

    def close(self) -> None:
        self.slots.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.nodes.close()


def _unreadable(node: Node, error: Exception) -> ProtocolError:
    """What a reply redis-py could not read (``replies.UNREADABLE``) counts as: a connection
    out of step."""
    return ProtocolError(f"{node[0]}:{node[1]} sent a reply redis-py cannot read: {error!r:.120}")


def _as_value(result: Any, value_bytes: int) -> Any:
    """A reply redis-py read (an ASK followed) in the form ``run(value_bytes=...)`` gives."""
    if isinstance(result, (bytes, bytearray)):
        view = memoryview(result)
        return view if len(view) == value_bytes else Odd(view, len(view))
    return result
