"""RemoteTier: block payloads in a Redis Cluster (or one Redis server), shared by many nodes.

A dumb slot store like the others, except that the slots belong to Redis: the tier names keys
(tiers.remote.naming), frames values (tiers.remote.codec), routes each key to its primary
(tiers.remote.slot_map), sends one pipeline per primary (tiers.remote.calls over
tiers.remote.topology) and counts. It decides nothing about what to keep: Redis evicts on its
own (``maxmemory`` + ``allkeys-lru``), and a block that vanished is a miss.

It is a cache. No method raises for anything the remote does (timeouts, refused connections,
CLUSTERDOWN, TRYAGAIN, OOM, MOVED, auth errors, garbage values): every failure is a counted
miss or a counted dropped write. Only caller errors (bad arguments) raise.

A remote hit costs one round trip: ``get`` sends one pipeline of GETs per primary, all
primaries at once, and checks each value where it was received before copying its payload
once into the caller's memory. ``lookup`` (the store's question) answers from fresh hints
where it can, GETs a short unknown run (keeping the values for the ``get`` that follows) and
asks EXISTS of a long one (tiers.remote.reads, tiers.remote.hints).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.tiers.buffers import byte_view
from kvstore.tiers.remote import codec
from kvstore.tiers.remote.calls import RemoteCalls
from kvstore.tiers.remote.counters import RemoteCounters
from kvstore.tiers.remote.deadline import deadline
from kvstore.tiers.remote.hints import HINT_TTL_S, Hints, KeptValues
from kvstore.tiers.remote.info import NodeInfo, NodeInfoCache
from kvstore.tiers.remote.naming import DEFAULT_PREFIX, MAX_RUN_LENGTH, block_name, check_prefix, name_pattern
from kvstore.tiers.remote.reads import LOOKUP_GET_BYTES, RemoteReads
from kvstore.tiers.remote.sweep import SweepResult, sweep_owner
from kvstore.tiers.remote.topology import TRANSFER_FLOOR, Topology
from kvstore.tiers.remote.url import Node, RemoteURL, parse_url
from kvstore.tiers.remote.writer import PendingWrite, Room, WriteBehind

log = logging.getLogger(__name__)


class RemoteTier:
    """Blocks of ``payload_bytes`` of one layout, under names derived from their block keys.

    Args:
        url: ``redis://``, ``rediss://``, ``redis+cluster://`` or ``rediss+cluster://`` (see
            tiers.remote.url); the password is never shown in repr, stats or errors.
        payload_bytes: bytes per block.
        layout_id: the layout fingerprint text; a value of another layout is a miss.
        prefix: first part of every Redis key name.
        run_length: G, blocks of a chain per hash slot (see tiers.remote.naming).
        timeout_s: the deadline of every call: by then each node has answered or is a
            timeout (a miss or a dropped write), however slowly it sends; a call that moves
            values gets, on top, their time at 100 MB/s (its busiest node's bytes).
        queue_blocks: write-behind bound: at most this many framed values are held (queued,
            being sent, or being framed); blocks offered beyond it are dropped uncopied.
        batch_blocks: most blocks one write-behind round sends.
        breaker_threshold, breaker_cooldown_s: consecutive failures that open a node's
            circuit, and the wait before the first probe.
        hint_ttl_s: how long what the remote said of a block stands (0: no hints, no kept
            values); another node's write is seen at most this late.
        lookup_get_bytes: a lookup GETs (and keeps the values for the read that follows) an
            unknown run of at most this many value bytes, and asks EXISTS of a longer one.
        replica_reads: reads of a primary that fails or whose circuit is open go to one of
            its replicas (``READONLY``) until the cluster promotes one; a value the replica
            lacks or holds stale is a miss by its own checks (tiers.remote.topology).

    Every batch method takes ``tags``: the group head key of each block (``naming.group_tags``);
    None means each block is its own head, which is right only for ``run_length == 1``. Writes
    take ``owners``: each block's owner tag (``codec.OWNER_BYTES``, the writer's tenant),
    recorded in its value for ``forget_owner``; None records none.

    Attributes:
        on_stored: called with the keys of each batch a put or the write-behind wrote (not
            those it found there already); None: nobody listens. It runs on
            the writing thread and must not block; an exception from it is logged and ignored.
    """

    def __init__(
        self, url: str | RemoteURL, payload_bytes: int, layout_id: str, *, prefix: str = DEFAULT_PREFIX,
        run_length: int = 1, timeout_s: float = 0.5, queue_blocks: int = 256, batch_blocks: int = 64,
        breaker_threshold: int = 3, breaker_cooldown_s: float = 0.5, hint_ttl_s: float = HINT_TTL_S,
        lookup_get_bytes: int = LOOKUP_GET_BYTES, replica_reads: bool = True,
    ) -> None:
        if not isinstance(payload_bytes, int) or payload_bytes <= 0:
            raise ValueError(f"payload_bytes must be a positive int, got {payload_bytes!r}")
        if not isinstance(run_length, int) or not 1 <= run_length <= MAX_RUN_LENGTH:
            raise ValueError(f"run_length must be 1..{MAX_RUN_LENGTH}, got {run_length!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.url = url if isinstance(url, RemoteURL) else parse_url(url)
        self.payload_bytes, self.layout_id = payload_bytes, layout_id
        self.prefix, self.run_length, self.timeout_s = check_prefix(prefix), run_length, timeout_s
        self._layout = codec.layout_digest(layout_id)
        self.counters = RemoteCounters()
        self._topology = Topology(self.url, timeout_s, breaker_threshold=breaker_threshold,
                                  breaker_cooldown_s=breaker_cooldown_s)
        self._info = NodeInfoCache(self._topology)
        self._calls = RemoteCalls(self._topology, self.counters, payload_bytes, replica_reads=replica_reads)
        self.on_stored: Callable[[list[bytes]], None] | None = None
        self._writer = WriteBehind(self._send, queue_blocks, batch_blocks,
                                   lambda n: self.counters.add(dropped=n))
        self._reads = RemoteReads(self._calls.ask, self.names, self.counters, self._layout, payload_bytes, hint_ttl_s,
                                  lookup_get_bytes)

    def __repr__(self) -> str:
        return f"RemoteTier({self.url.redacted()!r}, payload_bytes={self.payload_bytes}, G={self.run_length})"

    # ----------------------------------------------------------------------------- names

    def names(self, keys: Sequence[bytes], tags: Sequence[bytes] | None = None) -> list[bytes]:
        """The Redis key name of each block."""
        self._check_tags(keys, tags)
        return [block_name(k, t, self.prefix, self.run_length) for k, t in zip(keys, tags or keys, strict=True)]

    def owner(self, name: bytes) -> Node | None:
        """The primary that owns a key name now (as the client last learned the cluster's
        slot map), or None if no known node does."""
        return self._topology.owner(name)

    def _check_tags(self, keys: Sequence[bytes], tags: Sequence[bytes] | None) -> None:
        if tags is None and self.run_length != 1:
            raise ValueError(f"with run_length={self.run_length} every block needs its group tag")
        if tags is not None and len(tags) != len(keys):
            raise ValueError(f"got {len(tags)} tags for {len(keys)} keys")

    # ----------------------------------------------------------------------------- reads

    def contains(self, keys: Sequence[bytes], tags: Sequence[bytes] | None = None) -> list[bool]:
        """Per block: does the remote hold a value under its name now? (Asked, never hinted;
        failures: False.)"""
        return self._reads.contains(keys, tags)

    def exists(self, keys: Sequence[bytes], tags: Sequence[bytes] | None = None) -> int:
        """How many leading blocks of ``keys`` the remote holds (pipelined EXISTS, one round
        trip per node, stop counting at the first gap). Asked, never hinted."""
        found = self.contains(keys, tags)
        return found.index(False) if False in found else len(found)

    def lookup(self, keys: Sequence[bytes], tags: Sequence[bytes] | None = None) -> int:
        """How many leading blocks of ``keys`` the remote holds, as far as it is worth asking:
        fresh hints answer without a request; the rest is one round trip, a GET of a short run
        (the values kept for the ``get`` that follows) or EXISTS of a long one (reads.py)."""
        self._check_tags(keys, tags)
        with self._read_deadline(keys):
            return self._reads.lookup(keys, tags)

    def get(self, keys: Sequence[bytes], outs: Sequence[Any], tags: Sequence[bytes] | None = None, *,
            leading: bool = False, owners: list[bytes | None] | None = None) -> list[bool]:
        """Read blocks into caller memory (CPU tensors or writable buffers of >= payload_bytes).

        One pipeline of GETs per primary, all at once, for the blocks a lookup did not keep
        and whose fresh hint does not say the remote lacks them; with ``leading`` (only the
        leading run matters to the caller), for none past the first such block, and only the
        leading run of hits is delivered. Each value is checked where it was received and its
        payload copied once into ``outs[i]``.

        ``owners``: a list of ``len(keys)`` filled with each delivered block's owner tag (None
        for the others).

        Returns:
            Per block, True when ``outs[i][:payload_bytes]`` now holds exactly the bytes put
            under ``keys[i]``. A missing, unreachable or invalid value is False (and counted);
            an invalid one is also deleted from the remote.
        """
        with self._read_deadline(keys):
            return self._reads.get(keys, outs, tags, leading, owners)

    def _read_deadline(self, keys: Sequence[bytes]) -> contextlib.AbstractContextManager[None]:
        """One deadline over a read's calls: its GETs (or EXISTS), the slot map a first read
        asks for, and the DEL of the bad values it found, so a read over a slow network takes
        one deadline, not one per call: ``timeout_s`` plus all its values' time at
        TRANSFER_FLOOR (each call keeps its own deadline where that is earlier)."""
        value_bytes = codec.header_bytes(len(keys[0])) + self.payload_bytes if keys else 0
        return deadline(time.monotonic() + self.timeout_s + len(keys) * value_bytes / TRANSFER_FLOOR)

    @property
    def hints(self) -> Hints:
        """Whether the remote held each block when last asked (a lookup's first answer)."""
        return self._reads.hints

    @property
    def kept(self) -> KeptValues:
        """Values a lookup fetched, waiting for the read that follows it."""
        return self._reads.kept

    @property
    def lookup_get_bytes(self) -> int:
        """The longest unknown run (value bytes) a lookup GETs; past it, EXISTS."""
        return self._reads.lookup_get_bytes

    @lookup_get_bytes.setter
    def lookup_get_bytes(self, value: int) -> None:
        self._reads.lookup_get_bytes = value

    # ----------------------------------------------------------------------------- writes

    def encode(self, keys: Sequence[bytes], payloads: Sequence[Any], tags: Sequence[bytes] | None = None,
               owners: Sequence[bytes] | None = None) -> list[PendingWrite]:
        """Name and frame blocks (each value a private copy of its payload)."""
        if len(payloads) != len(keys):
            raise ValueError(f"put needs one payload per key: {len(keys)} keys, {len(payloads)} payloads")
        if owners is not None and len(owners) != len(keys):
            raise ValueError(f"put needs one owner per key: {len(keys)} keys, {len(owners)} owners")
        names = self.names(keys, tags)
        pending = []
        for i, (name, key, payload) in enumerate(zip(names, keys, payloads, strict=True)):
            view = byte_view(payload, writable=False)[0]
            if view.nbytes < self.payload_bytes:
                raise ValueError(f"payload of {view.nbytes} bytes is shorter than payload_bytes={self.payload_bytes}")
            owner = codec.NO_OWNER if owners is None else owners[i]
            pending.append(PendingWrite(name, codec.encode(key, self._layout, view[: self.payload_bytes], owner),
                                        key, owner))
        return pending

    def put(self, keys: Sequence[bytes], payloads: Sequence[Any], tags: Sequence[bytes] | None = None,
            owners: Sequence[bytes] | None = None) -> int:
        """Write blocks now, sending only those the remote lacks. Returns how many were sent
        and acknowledged; failures are counted in ``dropped`` (and ``errors``)."""
        return self._send(self.encode(keys, payloads, tags, owners))

    def put_async(self, keys: Sequence[bytes], payloads: Sequence[Any], tags: Sequence[bytes] | None = None,
                  owners: Sequence[bytes] | None = None) -> int:
        """Copy blocks into the write-behind queue and return at once: how many were queued.
        Only the leading blocks the queue has room for are copied; the rest are dropped and
        counted without being read. ``flush`` waits for the queued ones."""
        if len(payloads) != len(keys):
            raise ValueError(f"put needs one payload per key: {len(keys)} keys, {len(payloads)} payloads")
        self._check_tags(keys, tags)
        with self.reserve(len(keys)) as room:
            n = room.size
            return self.put_into(room, keys[:n], payloads[:n], None if tags is None else tags[:n],
                                 None if owners is None else owners[:n])

    def reserve(self, n: int) -> Room:
        """Claim room in the write-behind queue for up to ``n`` blocks before making anything
        to send (``put_async`` in two steps, for a caller that encodes blocks first): the
        blocks past ``room.size`` are dropped and counted now. Use it as ``with`` block and
        hand it to ``put_into``; room left unused is counted as dropped."""
        return self._writer.reserve(n)

    def put_into(self, room: Room, keys: Sequence[bytes], payloads: Sequence[Any],
                 tags: Sequence[bytes] | None = None, owners: Sequence[bytes] | None = None) -> int:
        """Frame up to ``room.size`` blocks and queue them in ``room``: how many were queued."""
        if len(keys) > room.size:
            raise ValueError(f"{len(keys)} blocks for room of {room.size}")
        return room.fill(self.encode(keys, payloads, tags, owners))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block given to ``put_async`` is written or counted as dropped."""
        return self._writer.flush(timeout)

    @property
    def num_pending(self) -> int:
        """Blocks in the write-behind queue or being sent."""
        return self._writer.num_pending

    def _send(self, items: list[PendingWrite]) -> int:
        """Write ``items`` now (``RemoteCalls.send``), note them held and tell ``on_stored``;
        how many were written."""
        stored = self._calls.send(items)
        self.hints.note(stored, True)
        if stored and self.on_stored is not None:
            try:
                self.on_stored(stored)
            except Exception:
                log.exception("remote tier on_stored callback failed")
        return len(stored)

    def delete(self, keys: Sequence[bytes], tags: Sequence[bytes] | None = None) -> None:
        """Remove blocks from the remote (best effort, failures counted)."""
        self._reads.forget(keys)
        self._calls.ask(self.names(keys, tags), "DEL")

    def forget_owner(self, owner: bytes, flush_timeout: float = 30.0) -> SweepResult:
        """Delete every value of this prefix whose header names ``owner``, on every primary
        (tiers.remote.sweep), after dropping that owner's queued writes and waiting for the
        batch being sent; what this tier learned lately (hints, kept values) goes too.

        Unlike the other methods it reports what the remote did: ``failed`` names each node
        it could not sweep whole (and says so when the queue did not drain in time).
        """
        if len(owner) != codec.OWNER_BYTES:
            raise ValueError(f"an owner tag is {codec.OWNER_BYTES} bytes, got {len(owner)}")
        self._writer.discard(owner)
        drained = self._writer.flush(flush_timeout)  # a batch on its way could land after the sweep
        self.forget_hints()
        result = sweep_owner(self._topology, name_pattern(self.prefix), owner, self.timeout_s)
        self.forget_hints()  # a lookup during the sweep may have kept one of its values
        if not drained:
            result.failed.append(f"the write-behind queue did not drain in {flush_timeout} s")
        return result

    def forget_hints(self) -> None:
        """Drop every hint and kept value: the next lookups and reads ask the remote."""
        self._reads.hints.clear()
        self._reads.kept.clear()

    # ----------------------------------------------------------------------------- state

    def nodes(self) -> list[NodeInfo]:
        """Each primary's memory, evictions and keys from INFO (cached ~1 s; never raises)."""
        return self._info.nodes()

    def stats(self) -> dict[str, int]:
        """capacity_bytes (sum of maxmemory), used_bytes (used_memory), num_blocks (DBSIZE),
        evictions (evicted_keys) over the primaries that answered, then our counters
        (hits, misses, bytes_read, bytes_written, errors, dropped, skipped, pending, ...)."""
        nodes = [n for n in self.nodes() if n.up]
        out = {
            "capacity_bytes": sum(n.maxmemory for n in nodes),
            "used_bytes": sum(n.used_memory for n in nodes),
            "num_blocks": sum(n.keys for n in nodes),
            "evictions": sum(n.evicted_keys for n in nodes),
            "nodes_up": len(nodes),
        }
        out.update(self.counters.snapshot())
        out["pending"] = self.num_pending
        return out

    def close(self, timeout: float | None = 5.0) -> None:
        """Send what the write-behind queue holds (up to ``timeout``), then disconnect."""
        self._writer.close(timeout)
        self._topology.close()

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
