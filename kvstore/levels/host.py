"""HostLevel: host RAM (rank 0) over tiers.host.HostTier. Puts land here; promotions come here."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.eviction import EvictionPolicy
from kvstore.index import HOST, BlockEntry
from kvstore.levels.base import Level
from tiers.host import HostTier


class HostLevel(Level):
    """The host pool as a level. Beyond the level interface it offers what only memory can:
    zero-copy slot views and run copies into a caller's rows (the read path's fast case), and
    the shared pool that the daemon's same-host clients map."""

    def __init__(self, tier: HostTier, policy: EvictionPolicy) -> None:
        super().__init__(HOST, 0, policy)
        self.tier = tier

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

    @property
    def pinned(self) -> bool:
        return self.tier.pinned

    @property
    def shared_pool(self) -> tuple[str, int, int] | None:
        """``(path, slot_bytes, num_slots)`` of the shared pool, or None if not shared."""
        path = self.tier.shm_path
        return None if path is None else (path, self.tier.slot_bytes, self.tier.num_slots)

    def allocate(self, n: int) -> list[int]:
        return self.tier.allocate(n)

    def release(self, slots: Sequence[int]) -> None:
        self.tier.release(slots)

    def write(self, entries: Sequence[BlockEntry], slots: Sequence[int],
              payloads: torch.Tensor | Sequence[torch.Tensor]) -> bool:
        if isinstance(payloads, torch.Tensor):  # [n, payload] rows: one copy per run of slots
            self.tier.write(slots, payloads)
        else:
            size = self.tier.payload_bytes
            for slot, payload in zip(slots, payloads, strict=True):
                self.tier.slot_view(slot)[:size].copy_(payload[:size])
        return True

    def read(self, keys: Sequence[bytes], slots: Sequence[int], outs: Sequence[torch.Tensor]) -> list[bool]:
        size = self.tier.payload_bytes
        for slot, out in zip(slots, outs, strict=True):
            out[:size].copy_(self.tier.slot_view(slot)[:size])
        return [True] * len(slots)

    def read_rows(self, slots: Sequence[int], dst: torch.Tensor) -> None:
        """Copy the slots' payloads into consecutive rows ``dst`` ([n, payload] uint8)."""
        self.tier.read(slots, dst)

    def views(self, slots: Sequence[int]) -> list[torch.Tensor]:
        """Zero-copy views of whole slots (page-aligned, ``slot_bytes`` long)."""
        return [self.tier.slot_view(slot) for slot in slots]

    def export(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[torch.Tensor | None]:
        return list(self.views(slots))

    def drop(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        self.tier.release(slots)

    def check_integrity(self, held: dict[bytes, int]) -> None:
        self.tier.check_integrity(list(held.values()))

    def close(self) -> None:
        self.tier.close()
