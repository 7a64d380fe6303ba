"""Level: one tier of the store's cascade, as the cascade sees it.

A level is a slot store (a dumb tier from ``kvstore.tiers``) plus what the cascade needs to run it:
its eviction policy, its counters, its admission rule and its codec (``coding``: how it
represents the raw blocks the cascade hands it; None stores them as they are). Every level
answers the same small
interface, so the cascade walks a list and never asks which medium it is talking to; a new
medium is a new ``Level`` subclass and one more entry in the list.

Rank 0 is host RAM: puts land there, promotions go there, leases map it. Ranks below it are
ordered by speed; evicting from rank r demotes to rank r + 1, and the last level drops.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.policy.admission import AdmissionPolicy, AdmitAll, make_admission
from kvstore.policy.eviction import DeferredAccess, EvictionPolicy, Key
from kvstore.policy.tenant_policy import TenantPolicy
from kvstore.store.index import BlockEntry
from kvstore.store.levels.coding import LevelCodec
from kvstore.store.stats import TierCounters, tier_stats

BlocksReady = Callable[[list[int], list[bool]], None]  # (block indices, whether each holds its block)


@dataclass(frozen=True)
class Recovered:
    """A block an earlier run left in a persistent level (the level's catalog is the truth)."""

    key: bytes
    slot: int
    tenant: str
    created: float
    last_access: float


class Level(ABC):
    """One tier of the cascade. The cascade calls every method under the store lock, except
    ``read``, which it calls on blocks it holds as being read (``readers > 0``), so their slots
    cannot be dropped or reused meanwhile, and ``write`` of a write-through put's blocks into
    slots it took (``WritePath.finish``): a level below host takes such a write beside its
    other calls.

    Attributes:
        name: the tier's name in lookups, stats and events ("host", "disk", ...).
        rank: the level's position in the cascade (0 = host RAM); ``entry.slots[rank]``.
        policy: which of the level's blocks goes first when it must make room.
        tenants: that policy's ``TenantPolicy`` (blocks and counters per tenant, quotas),
            when it is one (as ``build_levels`` makes it), else None.
        counters: hits, misses, evictions, bytes moved, errors.
        admission: which blocks demoted from the level above it takes (kvstore/policy/admission.py).
        coding: the level's lossy codec, or None for raw blocks. Payloads crossing the
            interface are always raw (``raw_bytes`` per block); a coded level encodes on
            ``write`` and decodes on ``read``.
    """

    def __init__(self, name: str, rank: int, policy: EvictionPolicy, admission: str | AdmissionPolicy = "all",
                 coding: LevelCodec | None = None) -> None:
        self.name = name
        self.rank = rank
        self.policy = policy
        inner = policy.policy if isinstance(policy, DeferredAccess) else policy
        self.tenants = inner if isinstance(inner, TenantPolicy) else None
        self.counters = TierCounters()
        self.admission = make_admission(admission) if isinstance(admission, str) else admission
        self.coding = coding

    @property
    def lossy(self) -> bool:
        """Whether the level's copies differ from the bytes put."""
        return self.coding is not None

    @property
    @abstractmethod
    def payload_bytes(self) -> int:
        """Bytes the medium stores per block (the encoded size under a codec)."""

    @property
    def raw_bytes(self) -> int:
        """Bytes of one raw block, as payloads cross the level's interface."""
        return self.coding.raw_bytes if self.coding is not None else self.payload_bytes

    def describe_codec(self) -> dict[str, Any]:
        """``{"codec", "lossy", "block_bytes", ...}``: how the level represents blocks."""
        if self.coding is None:
            return {"codec": "none", "lossy": False, "block_bytes": self.payload_bytes}
        return self.coding.describe()

    def admit(self, entries: list[BlockEntry], can_evict: Callable[[Key], bool] | None = None) -> list[BlockEntry]:
        """Those of ``entries`` (demoted from the level above, chain order) this level takes:
        its admission policy's answer, given the level's next victim (``can_evict``: which
        blocks may be victims) when it has no room for them all."""
        if not entries or isinstance(self.admission, AdmitAll):
            return entries
        full = self.num_free < len(entries)
        victim = self.policy.peek_victim(can_evict) if full else None
        flags = self.admission.admit([e.key for e in entries], [e.num_uses for e in entries], victim, full)
        return [e for e, ok in zip(entries, flags, strict=True) if ok]

    def tenant_policy(self) -> TenantPolicy | None:
        """``tenants``, with hits recorded by a ``DeferredAccess`` applied first (lock held)."""
        if isinstance(self.policy, DeferredAccess):
            self.policy.apply_pending()
        return self.tenants

    # ----------------------------------------------------------------------------- occupancy

    @property
    @abstractmethod
    def num_slots(self) -> int: ...

    @property
    @abstractmethod
    def num_free(self) -> int:
        """Slots neither holding a block nor handed out by ``allocate``."""

    @property
    @abstractmethod
    def num_used(self) -> int:
        """Slots holding a block."""

    @property
    @abstractmethod
    def slot_bytes(self) -> int: ...

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    # ----------------------------------------------------------------------------- slots and bytes

    @abstractmethod
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free slots (the caller made room first). Raises TierFullError if fewer."""

    @abstractmethod
    def release(self, slots: Sequence[int]) -> None:
        """Give back slots from ``allocate`` that were never published."""

    @abstractmethod
    def write(self, entries: Sequence[BlockEntry], slots: Sequence[int],
              payloads: torch.Tensor | Sequence[torch.Tensor]) -> bool:
        """Store ``payloads[i]`` (raw uint8 rows, at least ``raw_bytes`` each) in ``slots[i]`` for
        ``entries[i]``, durably for a persistent level (encoded first under a codec).

        Returns:
            True when every block is stored; False when the medium failed or the codec
            refused a block: nothing is stored, the slots are free again, the error is counted.
        """

    @abstractmethod
    def read(self, keys: Sequence[bytes], slots: Sequence[int], outs: Sequence[torch.Tensor],
             on_ready: BlocksReady | None = None) -> list[bool]:
        """Copy each slot's block into ``outs[i]`` (raw rows of at least ``raw_bytes``; decoded
        under a codec) and verify it. ``on_ready(blocks, ok)``, if given, is told of blocks,
        each at most once, as soon as their ``outs[i]`` are final (``ok``: whether each holds
        its block), on whatever thread finished them and before ``read`` returns, so a caller
        can move them on while the rest is read (a disk hands them over per transfer). A
        block it never names has only the returned flag.

        Returns:
            Per block, True when ``outs[i]`` holds the block written under ``keys[i]``. A
            False block is gone from the level (a corrupt slot, or an encoding this reader
            refuses, is dropped and counted); the caller forgets that copy. Never raises for
            a medium failure.
        """

    def export(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[torch.Tensor | None]:
        """The payloads of ``slots`` for a demotion to the level below: zero-copy views where
        the medium is memory, else verified copies (None for a block that failed its read)."""
        outs = [torch.empty(self.raw_bytes, dtype=torch.uint8) for _ in slots]
        flags = self.read(keys, slots, outs)
        return [out if good else None for out, good in zip(outs, flags, strict=True)]

    @abstractmethod
    def drop(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """The blocks leave the level (evicted or deleted): their slots become free."""

    def recover(self) -> list[Recovered]:
        """Blocks a persistent level holds from an earlier run, newest first (none by default)."""
        return []

    # ----------------------------------------------------------------------------- state

    def stats(self) -> dict[str, Any]:
        """capacity_bytes, used_bytes, num_blocks and the counters (see kvstore.store.stats)."""
        return tier_stats(self.counters, self.capacity_bytes, self.num_used, self.slot_bytes)

    @abstractmethod
    def check_integrity(self, held: dict[bytes, int]) -> None:
        """Assert the medium agrees with the index's view ``held`` (key -> slot)."""

    @abstractmethod
    def close(self) -> None:
        """Release the medium. The cascade has written back what it wanted to keep."""


class SlotLevel(Level):
    """A level whose medium is one of ``kvstore.tiers``' slot stores, ``self.tier`` (host pool, disk
    slab): occupancy and handing out slots are the tier's own; subclasses move the bytes."""

    tier: Any  # tiers.host.HostTier or tiers.disk.DiskTier: the same occupancy interface

    @property
    def payload_bytes(self) -> int:
        return int(self.tier.payload_bytes)

    @property
    def num_slots(self) -> int:
        return int(self.tier.num_slots)

    @property
    def num_free(self) -> int:
        return int(self.tier.num_free)

    @property
    def num_used(self) -> int:
        return int(self.tier.num_used)

    @property
    def slot_bytes(self) -> int:
        return int(self.tier.slot_bytes)

    @property
    def capacity_bytes(self) -> int:
        return int(self.tier.capacity_bytes)

    def allocate(self, n: int) -> list[int]:
        return list(self.tier.allocate(n))

    def release(self, slots: Sequence[int]) -> None:
        self.tier.release(slots)
