"""Write-through: a put's (or commit's) blocks reach the level below host before any reader
sees them, in two halves around the disk write, which runs without the store lock.

``begin`` (lock held): the blocks' bytes are in host slots that no reader sees yet (reserved);
it marks them ``writing`` (landing in host RAM: whoever needs them waits,
``InFlight.wait_written``) and as being read (never evicted), claims them against their
tenants' hard quotas, and takes their slots below (making room there). ``finish`` (lock free)
writes them down, then under the lock publishes them below and on host (``on_host``: the
write path's announcement), or, when some did not get there, publishes none of them on host
and raises: the put is not acknowledged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstore.errors import CapacityError, KVStoreError, TierError
from kvstore.store.cascade import Cascade
from kvstore.store.index import BlockEntry


@dataclass
class DurableWrite:
    """A write-through put or commit between its two halves: ``placed`` (chain order, each
    ``writing`` and read-held) have their bytes in ``host_slots``, reserved and not yet theirs;
    ``todo``, those of them the level below lacks, go to ``below_slots`` (heads first: the
    last ``missing`` of ``todo`` found no slot below)."""

    placed: list[BlockEntry]
    host_slots: list[int]
    todo: list[BlockEntry]
    payloads: list[torch.Tensor]  # raw bytes of each of ``todo``
    below_slots: list[int]
    missing: int
    refreshed: list[bytes]  # keys of the same chain host held already: touched after the placement
    raw: list[torch.Tensor] | None  # the bytes put, for shared levels taking puts (None: host's)
    num_reserved: int  # host slots reserved for this write (a commit: its whole lease)
    unused: list[int]  # reserved slots no block takes (a commit's keys host held), freed on success
    own_slots: bool  # a put's: its host slots are freed on failure (a commit's caller cancels them)
    short_of: str = ""  # why ``missing`` blocks found no slot below
    error: KVStoreError | None = None  # raised once the write settled (a put's tails found no room)
    claimed: dict[str, int] | None = None  # host blocks claimed per tenant until it settles (hard quotas)


class WriteThrough:
    """The two halves of write-through over one store's cascade.

    Args:
        cascade: the store's cascade (its level 1 is the one written through to).
        on_host: ``on_host(placed, refreshed, raw)``, called under the lock once the blocks are
            below and placed on host: announce them (and touch ``refreshed``, the keys of the
            same chain host held already, where host still holds them).
    """

    def __init__(self, cascade: Cascade,
                 on_host: Callable[[list[BlockEntry], list[bytes], list[torch.Tensor] | None], None]) -> None:
        self.cascade = cascade
        self.on_host = on_host

    def begin(self, placed: list[BlockEntry], host_slots: list[int], payloads: Sequence[torch.Tensor | None],
                       refreshed: list[bytes], raw: list[torch.Tensor] | None, *, num_reserved: int,
                       unused: list[int], own_slots: bool) -> DurableWrite:
        """Write-through's first half (lock held): mark ``placed`` (chain order; bytes in
        ``host_slots``, not placed) as being written and read, and take slots in the level
        below for those it lacks, making room there; ``finish`` does the rest."""
        cascade = self.cascade
        below = cascade.levels[1]
        cascade.inflight.start_writing(placed, 0)  # first: making room below must not evict what is being written
        claimed = cascade.quota.claim_entries(placed)  # on their way into host RAM: held, for hard quotas
        try:
            todo = [(e, p) for e, p in zip(placed, payloads, strict=True) if e.slots[below.rank] is None]
            short = len(todo) - below.num_free
            if short > 0:
                cascade.make_room(below.rank, short)
            n = min(len(todo), below.num_free)
            below_slots = below.allocate(n) if n else []
        except BaseException:
            cascade.inflight.end_writing(placed)
            self._unclaim(claimed)
            raise
        missing = len(todo) - n
        short_of = (f"need {missing} {below.name} slots, {below.num_free} free of {below.num_slots} "
                    "(the rest pinned or being read)") if missing else ""
        return DurableWrite(placed, host_slots, [e for e, _ in todo], [p for _, p in todo],  # type: ignore[misc]
                            below_slots, missing, refreshed, raw, num_reserved, unused, own_slots, short_of,
                            claimed=claimed)

    def _unclaim(self, claimed: dict[str, int] | None) -> None:
        for owner, n in (claimed or {}).items():
            self.cascade.quota.unclaim(owner, n)

    def finish(self, w: DurableWrite) -> None:
        """Write-through's second half (lock free): write ``w``'s blocks to the level below,
        then, under the lock, publish them there and on host; or, when some did not get
        there, publish on host none of them (those written stay below), and raise.

        Raises:
            TierError: the level below failed to store them (its medium's error, with the
                numbers), or CapacityError: it had no evictable slot for them (the rest
                pinned or being read). Either way the put is not acknowledged; a put's host
                slots are free again, a commit's stay reserved for its caller to cancel.
        """
        cascade = self.cascade
        below = cascade.levels[1]
        n = len(w.below_slots)
        crashed: BaseException | None = None  # not a medium failure (those return False): re-raised
        try:
            written = n == 0 or below.write(w.todo[:n], w.below_slots, w.payloads[:n])
        except BaseException as exc:
            written, crashed = False, exc
        # A level that records its medium's last failure (the disk) names it.
        cause = None if written else getattr(below, "last_error", None)
        acknowledged = written and not w.missing
        with cascade.lock:
            cascade.inflight.end_writing(w.placed)  # waiters wake once the lock is let go, on what follows
            self._unclaim(w.claimed)  # placed on host below, or given up
            if written and n:
                cascade.placement.publish_written(below.rank, w.todo[:n], w.below_slots)
            if acknowledged:
                cascade.reservations.end(w.num_reserved, w.unused)
                cascade.placement.place(0, w.placed, w.host_slots)
                self.on_host(w.placed, w.refreshed, w.raw)
            else:
                if w.own_slots:
                    cascade.reservations.end(w.num_reserved, w.host_slots)
                for entry in w.placed:
                    if not entry.is_held and cascade.index.get(entry.key) is entry:
                        cascade.index.discard(entry.key)
        if crashed is not None:
            raise crashed
        if not acknowledged:
            lost = (0 if written else n) + w.missing
            what = (f"put not acknowledged under write-through: {lost} of {len(w.placed)} blocks "
                    f"did not reach {below.name}")
            if isinstance(cause, TierError):
                raise type(cause)(f"{what}: {cause}") from cause
            raise CapacityError(f"{what}: {w.short_of or 'its write failed'}")
        if w.error is not None:
            raise w.error

