"""The shared-memory write path: a put copied straight into slots of the daemon's mapped host pool.

A put takes a write lease on free host slots (``reserve``), copies its blocks in, and sends
``commit`` without waiting: the channel reads the reply in front of the next request, which
the next put sends once its own copy is done. Each reserve and commit also reserves the slots
of the put after next (``next`` in the reply), so a run of equal-sized puts copies while the
previous commit is on its way and pays no round trip of its own. No slot is written once half
its lease has passed, and a lease that went unwritten is given back, never committed
(docs/protocol.md, "Shared memory").
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from kvstore.client.channel import Channel, Meta, ReplyHandler, as_exception
from kvstore.client.copier import Copier
from kvstore.client.shm_reads import ShmReads
from kvstore.errors import CapacityError
from kvstore.protocol import Code
from kvstore.tiers.host import PayloadViews

WriteLease = tuple[int, list[int], float]  # (lease id, its slots, the last moment to start writing them)

log = logging.getLogger(__name__)


class ShmWrites:
    """Puts into one mapped pool over ``channel``; a committed put's slots go to ``reads``,
    the read cache, so this client reads its own puts back lock-free."""

    def __init__(self, channel: Channel, payloads: PayloadViews, reads: ShmReads) -> None:
        self._channel = channel
        self._payloads: PayloadViews | None = payloads  # None once closed
        self._reads = reads
        self._copier = Copier()  # a put's copy into the pool, beside the daemon's commit of the last
        self.leases: deque[WriteLease] = deque()  # reserved ahead for the next puts, up to two
        self.num_lost_puts = 0  # blocks of puts whose commit found its lease expired

    def close(self) -> None:
        """Stop the copier's helpers and let go of the pool: later puts go over the socket."""
        self._copier.close()
        self._payloads = None

    def put(self, keys: Sequence[bytes], src: torch.Tensor, group: int | None = None) -> bool:
        """Write the blocks into reserved host slots and send their commit, without waiting for
        its reply. False when nothing was written: the caller puts over the socket (which may
        still overflow to disk)."""
        payloads = self._payloads
        if payloads is None:
            return False
        n = len(keys)
        with self._channel.lock:
            lease = self._take_lease(n, keys)
        if lease is None:
            return False
        lease_id, slots, deadline = lease
        if time.monotonic() >= deadline:  # never start writing a slot past the lease
            self._channel.notify({"op": "release", "lease": lease_id, "kind": "write"})  # unwritten: never commit it
            return False
        self._copier.copy(payloads.pieces(slots, src))
        gens = self._reads.generations_of(slots)  # stable: the lease still holds the slots
        commit: dict[str, object] = {"op": "commit", "lease": lease_id, "keys": self._channel.keys_blob(keys),
                                     "reserve": n}
        if group is not None:
            commit["group"] = group
        with self._channel.lock:
            self._channel.pipeline_locked(commit, self._on_commit(list(keys), slots, gens))
        return True

    def _take_lease(self, n: int, keys: Sequence[bytes]) -> WriteLease | None:
        """A write lease of ``n`` slots for this put (the channel's lock held): one reserved
        ahead, or a new one (which also reserves the next put's). None when the host has no room."""
        leases = self.leases
        if not leases:
            self._channel.settle_locked()  # the last commit may bring one
        now = time.monotonic()
        while leases and (len(leases[0][1]) != n or now >= leases[0][2]):
            self._channel.notify_locked({"op": "release", "lease": leases.popleft()[0], "kind": "write"})
        if leases:
            return leases.popleft()
        sent_at = time.monotonic()
        try:
            reply = self._channel.call_locked({"op": "reserve", "keys": self._channel.keys_blob(keys), "reserve": n})[0]
        except CapacityError:
            return None
        self._keep_next(reply, sent_at)
        return reply["lease"], reply["slots"], sent_at + 0.5 * reply["lease_s"]

    def _keep_next(self, reply: Meta, sent_at: float) -> None:
        nxt = reply.get("next")
        if nxt is not None:
            self.leases.append((nxt["lease"], nxt["slots"], sent_at + 0.5 * nxt["lease_s"]))

    def _on_commit(self, keys: list[bytes], slots: list[int], gens: list[int]) -> ReplyHandler:
        """What to do with a commit's reply, read before the client's next request."""

        def settle(reply: dict[str, Any], sent_at: float) -> None:
            error = reply.get("error")
            if error is not None:
                code, message = int(error.get("code", 0)), str(error.get("message", ""))
                if code == Code.LEASE:  # the daemon stalled past the lease: those blocks were not stored
                    self.num_lost_puts += len(keys)
                    log.warning("a shared-memory put of %d blocks was not stored: %s", len(keys), message)
                    return
                raise as_exception(code, f"an earlier shared-memory put failed: {message}")
            self._reads.remember(keys, slots, gens)
            self._keep_next(reply, sent_at)

        return settle
