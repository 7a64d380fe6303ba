"""DiskLevel: local NVMe over tiers.disk.DiskTier (slab file + LMDB catalog, checksummed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvstore.eviction import EvictionPolicy
from kvstore.index import DISK, BlockEntry
from kvstore.levels.base import Level, Recovered
from kvstore.stats import tier_stats
from tiers.disk import DiskTier
from tiers.errors import TierError


class DiskLevel(Level):
    """The disk tier as a level. Writes are durable before they are published (the tier
    syncs payloads before its catalog commits); the catalog is the truth after a restart."""

    def __init__(self, tier: DiskTier, rank: int, policy: EvictionPolicy, admission: str,
                 namespace_id: str) -> None:
        super().__init__(DISK, rank, policy, admission)
        self.tier = tier
        self.namespace_id = namespace_id

    @property
    def num_slots(self) -> int:
        return self.tier.num_slots

    @property
    def num_free(self) -> int:
        return self.tier.num_free

    @property
    def num_used(self) -> int:
        return self.tier.num_used

    @property
    def slot_bytes(self) -> int:
        return self.tier.slot_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.tier.capacity_bytes

    def allocate(self, n: int) -> list[int]:
        return self.tier.allocate(n)

    def release(self, slots: Sequence[int]) -> None:
        self.tier.release(slots)

    def write(self, entries: Sequence[BlockEntry], slots: Sequence[int],
              payloads: torch.Tensor | Sequence[torch.Tensor]) -> bool:
        try:
            rows = list(payloads) if isinstance(payloads, torch.Tensor) else payloads
            self.tier.write([e.key for e in entries], slots, rows, [e.tenant for e in entries],
                            self.namespace_id)
        except TierError:
            self.counters.errors += 1
            return False
        return True

    def read(self, keys: Sequence[bytes], slots: Sequence[int], outs: Sequence[torch.Tensor]) -> list[bool]:
        try:
            return self.tier.read(keys, slots, outs)
        except TierError:
            self.counters.errors += 1
            return [False] * len(keys)

    def drop(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        self.tier.delete(keys)

    def recover(self) -> list[Recovered]:
        found = sorted(self.tier.entries(), key=lambda d: d.last_access, reverse=True)
        return [Recovered(d.key, d.slot, d.tenant, d.created, d.last_access) for d in found]

    def stats(self) -> dict[str, Any]:
        return tier_stats(self.counters, self.capacity_bytes, self.num_used, self.slot_bytes,
                          int(self.tier.stats().get("errors", 0)))

    def check_integrity(self, held: dict[bytes, int]) -> None:
        catalog = {d.key: d.slot for d in self.tier.entries()}
        assert catalog == held, f"disk catalog ({len(catalog)} blocks) and index ({len(held)} on disk) differ"
        self.tier.check_integrity()

    def close(self) -> None:
        self.tier.close()
