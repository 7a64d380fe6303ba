"""The shared-memory read path: blocks copied straight out of the daemon's mapped host pool.

A get copies first the leading blocks whose slots this client remembers (key -> slot and its
generation, noted while a lease held the slot), without asking the daemon: a copy counts only
if the slot's generation is unchanged after it (pool_map.py says why that is enough). The rest
of the run comes under a read lease (``get`` with ``shm``), whose slots are then remembered in
turn. Reads the daemon did not see reach it later as batched ``touch`` requests, in front of the
client's next request (docs/protocol.md, "Shared memory").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from kvstore.client.channel import Channel
from kvstore.client.pool_map import MappedPool
from kvstore.tiers.host import PayloadViews

TOUCH_BATCH = 4096  # lock-free reads told to the daemon in one touch, at the latest
TOUCH_DELAY_S = 0.05  # or once this long has passed, or with the next request


class ShmReads:
    """Reads out of one mapped pool over ``channel``; remembered slots make later reads lock-free
    on machines whose memory model allows it (``MappedPool.lock_free``), and when the pool file
    carries generations."""

    def __init__(self, channel: Channel, pool: MappedPool, payloads: PayloadViews) -> None:
        self._channel = channel
        self._pool: MappedPool | None = pool  # None once closed
        self.payloads: PayloadViews | None = payloads  # the pool's payloads as typed rows
        self.lock_free = pool.generations is not None and MappedPool.lock_free()
        self._slots: dict[bytes, tuple[int, int]] = {}  # key -> (slot, generation) of slots once held under a lease
        self._touched: list[bytes] = []  # blocks read lock-free, not yet told to the daemon
        self._touch_due = 0.0

    def close(self) -> None:
        """Let go of the pool: later reads copy nothing (the socket path reads them)."""
        self._pool = self.payloads = None

    def read(self, keys: Sequence[bytes], dst: torch.Tensor) -> int:
        """Copy the leading run of host blocks into ``dst``'s rows; returns how many."""
        n = self._read_cached(keys, dst)
        if n < len(keys):
            n += self._read_leased(keys[n:], dst[n:])
        return n

    def generations_of(self, slots: list[int]) -> list[int]:
        """The generations of slots this client holds under a lease (so they cannot change),
        read from the pool file; [] without lock-free reads."""
        if not self.lock_free or self._pool is None:
            return []
        return self._pool.generations_of(slots)

    def remember(self, keys: Sequence[bytes], slots: list[int], gens: list[int]) -> None:
        """Note where ``keys`` live (slots held under a lease), for lock-free reads (bounded by the pool)."""
        if self._pool is None or not self.lock_free or len(gens) != len(keys) or len(slots) != len(keys):
            return
        if len(self._slots) + len(keys) > 2 * self._pool.num_slots:
            self._slots.clear()  # stale entries cost only a lease; keep the map small
        self._slots.update(zip(keys, zip(slots, gens, strict=True), strict=True))

    def take_touches(self) -> list[dict[str, Any]]:
        """``touch`` requests for the blocks read lock-free since the last ones (their recency
        and read counters, which the daemon did not see); they need no reply and get none."""
        if not self._touched:
            return []
        keys, self._touched = self._touched, []
        return [{"op": "touch", "keys": b"".join(batch), "noreply": True} for batch in self._channel.key_batches(keys)]

    def _read_cached(self, keys: Sequence[bytes], dst: torch.Tensor) -> int:
        """Copy the leading run of remembered ``keys`` without taking a lease: a slot counts
        only if its generation is unchanged after the copy (the daemon bumps it before the slot
        can be reused, so then no other bytes were in it). Returns how many leading rows of
        ``dst`` hold their block; the daemon is told later (no reply)."""
        pool, payloads = self._pool, self.payloads
        if not self.lock_free or pool is None or payloads is None:
            return 0
        slots: list[int] = []
        gens: list[int] = []
        for key in keys:
            hit = self._slots.get(key)
            if hit is None:
                break
            slots.append(hit[0])
            gens.append(hit[1])
        if not slots:
            return 0
        # The generations are read one by one (a few dozen: numpy's setup would cost more
        # than the reads, several times more when the caches are cold, as a serving get finds them).
        n = _same_prefix(pool.generations_of(slots), gens)  # known stale before the copy: not copied
        if n:
            # torch's own copy (nothing runs beside a read), into the caller's typed rows
            payloads.read(slots if n == len(slots) else slots[:n], dst if n == len(dst) else dst[:n])
            n = _same_prefix(pool.generations_of(slots[:n]), gens)  # after: the copy is valid
        for key in keys[n : len(slots)]:
            self._slots.pop(key, None)  # maybe stale: the next lease names the slot again
        if n:
            self._touched += keys[:n]
            now = time.monotonic()
            if len(self._touched) >= TOUCH_BATCH or now >= self._touch_due:
                self._channel.send_due()
                self._touch_due = now + TOUCH_DELAY_S
        return n

    def _read_leased(self, keys: Sequence[bytes], dst: torch.Tensor) -> int:
        """Copy the leading run of host blocks under a read lease; returns how many."""
        payloads = self.payloads
        if payloads is None:
            return 0
        # The daemon's lease started after sent_at, so a copy done before sent_at + lease_s
        # was done under the lease; then the release needs no answer (it is posted).
        sent_at = time.monotonic()
        reply = self._channel.call({"op": "get", "keys": self._channel.keys_blob(keys), "shm": True})[0]
        n, deadline = reply["num_blocks"], sent_at + 0.5 * reply["lease_s"]
        copied = time.monotonic() < deadline  # never start copying past the lease
        gens = self.generations_of(reply["slots"]) if copied else []  # stable: the lease holds them
        if n and copied:
            payloads.read(reply["slots"], dst[:n])
        if copied and time.monotonic() < deadline:
            self._channel.post({"op": "release", "lease": reply["lease"]})
        elif not self._channel.call({"op": "release", "lease": reply["lease"]})[0]["valid"] or not copied:
            return 0
        self.remember(keys[:n], reply["slots"], gens)
        return n


def _same_prefix(now: list[int], want: list[int]) -> int:
    """How many leading entries of ``now`` equal those of ``want``."""
    if now == want:
        return len(now)
    n = 0
    for a, b in zip(now, want, strict=False):
        if a != b:
            break
        n += 1
    return n
