"""HostLevel: host RAM (rank 0) over tiers.host.HostTier. Puts land here; promotions come here.

With a codec (``host_codec``) the slots hold encoded blocks: twice as many fit, every write
encodes and every read decodes, and there are no zero-copy raw views (so no leases, no
shared pool).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.errors import CodecError
from kvstore.layout import raw_rows
from kvstore.policy.eviction import EvictionPolicy
from kvstore.results import HOST
from kvstore.store.index import BlockEntry
from kvstore.store.levels.base import BlocksReady, SlotLevel
from kvstore.store.levels.coding import LevelCodec
from kvstore.tiers.host import HostTier


class HostLevel(SlotLevel):
    """The host pool as a level. Beyond the level interface it offers what only memory can:
    zero-copy slot views and run copies into a caller's rows (the read path's fast case), and
    the shared pool that the daemon's same-host clients map."""

    def __init__(self, tier: HostTier, policy: EvictionPolicy, coding: LevelCodec | None = None) -> None:
        super().__init__(HOST, 0, policy, coding=coding)
        self.tier = tier

    @property
    def pinned(self) -> bool:
        return self.tier.pinned

    @property
    def shared_pool(self) -> tuple[str, int, int] | None:
        """``(path, slot_bytes, num_slots)`` of the shared pool, or None if not shared."""
        path = self.tier.shm_path
        return None if path is None else (path, self.tier.slot_bytes, self.tier.num_slots)

    def write(self, entries: Sequence[BlockEntry], slots: Sequence[int],
              payloads: torch.Tensor | Sequence[torch.Tensor]) -> bool:
        """As Level.write; a tensor of payloads may also be typed blocks ``[n, *block_shape]``
        (a put's), copied in with no byte view of their own."""
        if self.coding is not None:
            try:
                self.coding.encode(raw_rows(payloads) if isinstance(payloads, torch.Tensor) else payloads,
                                   self.views(slots))
            except CodecError:
                self.counters.errors += 1
                return False
            return True
        if isinstance(payloads, torch.Tensor):  # raw or typed rows: one copy per run of slots
            self.tier.write(slots, payloads)
        else:
            size = self.tier.payload_bytes
            for slot, payload in zip(slots, payloads, strict=True):
                self.tier.slot_view(slot)[:size].copy_(payload[:size])
        return True

    def read(self, keys: Sequence[bytes], slots: Sequence[int], outs: Sequence[torch.Tensor],
             on_ready: BlocksReady | None = None) -> list[bool]:
        if self.coding is not None:
            flags = self.coding.decode(self.views(slots), outs)
        else:
            size = self.tier.payload_bytes
            for slot, out in zip(slots, outs, strict=True):
                out[:size].copy_(self.tier.slot_view(slot)[:size])
            flags = [True] * len(slots)
        if on_ready is not None:
            on_ready(list(range(len(slots))), flags)
        return flags

    def read_rows(self, slots: Sequence[int], dst: torch.Tensor) -> None:
        """Copy the slots' blocks into ``dst``'s consecutive rows: raw ``[n, raw_bytes]``
        uint8, or typed blocks ``[n, *block_shape]`` (a get's ``out``)."""
        if self.coding is not None:
            self.coding.decode(self.views(slots), list(raw_rows(dst)))
        else:
            self.tier.read(slots, dst)

    def views(self, slots: Sequence[int]) -> list[torch.Tensor]:
        """Zero-copy views of whole slots (page-aligned, ``slot_bytes`` long; encoded blocks
        under a codec)."""
        return [self.tier.slot_view(slot) for slot in slots]

    def export(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[torch.Tensor | None]:
        if self.coding is not None:
            return super().export(keys, slots)
        return list(self.views(slots))

    def promotion_targets(self, slots: Sequence[int]) -> list[torch.Tensor]:
        """Where a lower level's raw blocks promoted into ``slots`` are read: the slots
        themselves, or (under a codec) raw buffers that ``finish_promotion`` encodes."""
        if self.coding is None:
            return self.views(slots)
        return list(torch.empty((len(slots), self.raw_bytes), dtype=torch.uint8))  # one buffer: one run

    def finish_promotion(self, slots: Sequence[int], targets: Sequence[torch.Tensor], good: Sequence[bool]) -> list[bool]:
        """Complete the promotion of the blocks read into ``targets``: per block, whether its
        slot now holds it."""
        keep = [i for i, ok in enumerate(good) if ok]
        if self.coding is not None and keep and \
                not self.write([], [slots[i] for i in keep], [targets[i] for i in keep]):
            return [False] * len(good)
        return list(good)

    def drop(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        self.tier.release(slots)

    def check_integrity(self, held: dict[bytes, int], retired: Sequence[int] = ()) -> None:
        """As Level.check_integrity; ``retired``: slots no block holds any more that are kept
        for their readers (Cascade.discard_copy), used all the same."""
        self.tier.check_integrity([*held.values(), *retired])

    def close(self) -> None:
        self.tier.close()
