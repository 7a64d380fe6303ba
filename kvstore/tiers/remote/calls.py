"""The tier's calls over its nodes, every failure counted once and none raised: ``ask`` (one
command per key name) and ``send`` (a put: EXISTS, then SET of the blocks a node lacks).

Both group the names by the primary that owns them (tiers.remote.slot_map) and send one
pipeline per primary, all at once (tiers.remote.topology), then turn each node's reply into a
result per name. RemoteReads asks through ``ask``; ``RemoteTier.put`` and the write-behind
send through ``send``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.tiers.remote.counters import RemoteCounters
from kvstore.tiers.remote.nodes import Command, NodeUnavailable, error_kind
from kvstore.tiers.remote.topology import Topology
from kvstore.tiers.remote.url import Node
from kvstore.tiers.remote.writer import PendingWrite

READS = frozenset({"GET", "EXISTS"})  # commands a replica may answer for its primary (READONLY)


class RemoteCalls:
    """Stateless beyond its counters; thread-safe as the topology and the counters are.

    Args:
        topology: the nodes and who owns which name.
        counters: the tier's; round trips, errors by kind, and a put's written, skipped and
            dropped blocks go here.
        payload_bytes: bytes per block (a written block counts this many ``bytes_written``).
        replica_reads: a read (``READS``) of a primary that fails goes to its replica.
    """

    def __init__(self, topology: Topology, counters: RemoteCounters, payload_bytes: int, *,
                 replica_reads: bool = True) -> None:
        self._topology, self.counters, self.payload_bytes = topology, counters, payload_bytes
        self.replica_reads = replica_reads

    def by_node(self, names: Sequence[bytes]) -> tuple[dict[Node, list[int]], list[int]]:
        """Indices of ``names`` per owning primary, and those no known node owns."""
        groups: dict[Node, list[int]] = {}
        unowned: list[int] = []
        for i, name in enumerate(names):
            node = self._topology.owner(name)
            if node is None:
                unowned.append(i)
            else:
                groups.setdefault(node, []).append(i)
        if unowned:
            self.counters.error("unavailable", 1)
        return groups, unowned

    def ask(self, names: Sequence[bytes], command: str, value_bytes: int | None = None) -> list[Any]:
        """``command name`` for every name, one pipeline per node in parallel. Per name: the
        reply, or the exception it failed with (each node failure counted once). With
        ``value_bytes`` (GET only), values as ``Topology.run`` reads them. A read (``READS``)
        of a primary that fails is answered by its replica where ``replica_reads`` (counted
        in the counters' ``replica_reads``)."""
        groups, unowned = self.by_node(names)
        most = max(map(len, groups.values()), default=0)
        replies = self._topology.run({n: [(command, names[i]) for i in idx] for n, idx in groups.items()},
                                     value_bytes=value_bytes, transfer_bytes=most * (value_bytes or 0),
                                     replica_reads=self.replica_reads and command in READS)
        if any(not isinstance(reply.error, NodeUnavailable) for reply in replies.values()):
            self.counters.add(round_trips=1)  # the nodes answer in parallel: one trip for the call
        out: list[Any] = [None] * len(names)
        for i in unowned:
            out[i] = ConnectionError("no node owns this slot yet")
        for node, idx in groups.items():
            reply = replies[node]
            if reply.failed_over is not None:  # the primary failed; its replica answered
                self.counters.error(error_kind(reply.failed_over))
                self.counters.add(replica_reads=1)
            if reply.results is None:
                assert reply.error is not None
                self.counters.error(error_kind(reply.error))
                for i in idx:
                    out[i] = reply.error
                continue
            for i, result in zip(idx, reply.results, strict=True):
                if isinstance(result, BaseException):
                    self.counters.error(error_kind(result))
                out[i] = result
        return out

    def send(self, items: list[PendingWrite]) -> list[bytes]:
        """EXISTS, then SET of the missing blocks, per node: each node's SETs follow its own
        EXISTS replies at once (no wait for the slowest node). Returns the keys written (in
        ``bytes_written``); the blocks found there already are ``skipped``, the failed ones
        ``dropped``."""
        groups, unowned = self.by_node([item.name for item in items])

        def missing(node: Node, held: list[Any]) -> list[int]:  # an error is not a 0: not sent
            return [i for i, r in zip(groups[node], held, strict=True) if r == 0]

        def sets(node: Node, held: list[Any]) -> list[Command]:
            return [("SET", items[i].name, items[i].value) for i in missing(node, held)]

        most = max((sum(len(items[i].value) for i in idx) for idx in groups.values()), default=0)
        replies = self._topology.run({n: [("EXISTS", items[i].name) for i in idx] for n, idx in groups.items()},
                                     then=sets, transfer_bytes=most)
        stored: list[bytes] = []
        written, failed = 0, len(unowned)
        for node, idx in groups.items():
            reply = replies[node]
            if reply.failed_over is not None:  # the primary failed; its replica answered
                self.counters.error(error_kind(reply.failed_over))
                self.counters.add(replica_reads=1)
            if reply.results is None:  # the EXISTS pipeline failed: nothing sent
                assert reply.error is not None
                self.counters.error(error_kind(reply.error))
                failed += len(idx)
                continue
            for result in reply.results:
                if isinstance(result, BaseException):
                    self.counters.error(error_kind(result))
                    failed += 1
                elif result != 0 and result != 1:  # no EXISTS of one key answers this: not sent, dropped
                    failed += 1
            self.counters.add(skipped=sum(1 for r in reply.results if r == 1))
            sent = missing(node, reply.results)
            if sent and reply.followup is None:  # the SET pipeline failed
                assert reply.error is not None
                self.counters.error(error_kind(reply.error))
                failed += len(sent)
                continue
            for i, result in zip(sent, reply.followup or (), strict=True):
                if result is True:
                    written += 1
                    stored.append(items[i].key)
                else:
                    failed += 1
                    if isinstance(result, BaseException):
                        self.counters.error(error_kind(result))
        self.counters.add(bytes_written=written * self.payload_bytes, dropped=failed)
        return stored
