"""Sweep: delete every value of one owner (a tenant's tag) from the remote tier.

Names are derived from salted block keys, so nothing in a name says whose block it is; the
value's header does (tiers.remote.codec: the owner at bytes 32..48). A sweep walks each
primary's keyspace with ``SCAN MATCH <prefix>:v2:g*`` (``naming.name_pattern``; the server
filters the names, nothing else travels), reads the fixed header of each name found with one
pipelined ``GETRANGE name 0 47`` per batch, and ``DEL``s those whose header names the owner,
in a pipeline on the same node (a node's SCAN lists only keys it holds). The cost is one
header read per block of the prefix in the cluster, whoever owns it: measured in
docs/remote.md ("Forgetting a tenant").

Unlike the rest of the tier a sweep reports its failures: a node it could not sweep whole
is named in ``SweepResult.failed`` (a forget must not claim what it did not do). Each round
(one SCAN, its GETRANGEs, its DELs) runs under the tier's deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from kvstore.tiers.remote import codec
from kvstore.tiers.remote.deadline import deadline
from kvstore.tiers.remote.replies import UNREADABLE
from kvstore.tiers.remote.topology import Topology

SCAN_COUNT = 1000  # names one SCAN round asks a node for (a hint to Redis, not a bound)
ROUND_S = 5.0  # at least this long for one round (a SCAN, its header reads and deletes)


@dataclass
class SweepResult:
    """What a sweep did: values deleted, names of the prefix looked at, nodes not swept whole."""

    deleted: int = 0
    scanned: int = 0
    failed: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.failed


def sweep_owner(topology: Topology, pattern: bytes, owner: bytes, timeout_s: float,
                count: int = SCAN_COUNT) -> SweepResult:
    """Delete every value whose header names ``owner``, under names matching ``pattern``, on
    every primary. Never raises for the remote: a node that fails is named in ``failed``."""
    result = SweepResult()
    for node in topology.primaries():
        where = f"{node[0]}:{node[1]}"
        try:
            _sweep_node(topology, node, pattern, owner, max(timeout_s, ROUND_S), count, result)
        except (RedisError, OSError, *UNREADABLE) as exc:  # (a SCAN reply redis-py cannot read, too)
            result.failed.append(f"{where}: {type(exc).__name__}: {exc}")
    if not topology.primaries():
        result.failed.append("no node of the remote tier is known (none answered)")
    return result


def _sweep_node(topology: Topology, node: tuple[str, int], pattern: bytes, owner: bytes, round_s: float,
                count: int, result: SweepResult) -> None:
    client = topology.client(node)
    cursor = 0
    while True:
        with deadline(time.monotonic() + round_s):
            cursor, names = client.scan(cursor, match=pattern, count=count)
            result.scanned += len(names)
            if names:
                pipe = client.pipeline(transaction=False)
                for name in names:
                    pipe.getrange(name, 0, codec.FIXED.size - 1)
                heads = pipe.execute(raise_on_error=False)
                doomed = [n for n, h in zip(names, heads, strict=True)
                          if isinstance(h, bytes) and codec.is_owned(h, owner)]
                if doomed:
                    pipe = client.pipeline(transaction=False)
                    for name in doomed:  # one key per DEL: names of one batch span slots
                        pipe.delete(name)
                    done = pipe.execute(raise_on_error=False)
                    result.deleted += sum(r for r in done if isinstance(r, int))
                    _raise_first(done)
                _raise_first(heads)  # a header not read: that value may be the owner's
        if int(cursor) == 0:
            return


def _raise_first(replies: list[object]) -> None:
    """A reply that is an error (a slot moving away, OOM...) fails the node's sweep."""
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply if isinstance(reply, RedisError | OSError) else RedisError(str(reply))
