"""Device tier: the KV pool ``[num_blocks, *block_shape]`` on cuda (or cpu) that an engine owns."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from kvstore.tiers.errors import TierFullError


class DevicePool:
    """A torch tensor pool of KV blocks plus its free list. Knows nothing of keys or policy.

    ``pool[block_id, layer, 0]`` is a layer's K for one block, ``[..., 1]`` its V; the paged
    attention kernels index these strided views by block id.
    """

    def __init__(
        self,
        num_blocks: int,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_blocks < 1:
            raise TierFullError(f"device pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_shape = tuple(block_shape)
        self.pool = torch.zeros((num_blocks, *self.block_shape), dtype=dtype, device=device)
        self.bytes_per_block = self.pool[0].numel() * self.pool.element_size()
        self.capacity_bytes = num_blocks * self.bytes_per_block
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free block ids. Raises TierFullError when fewer are free."""
        if n > len(self._free):
            raise TierFullError(f"need {n} device blocks, {len(self._free)} free of {self.num_blocks}")
        return [self._free.popleft() for _ in range(n)]

    def release(self, block_ids: Sequence[int]) -> None:
        self._free.extend(block_ids)

    def check_integrity(self, used_ids: Sequence[int]) -> None:
        free = set(self._free)
        used = set(used_ids)
        assert len(free) == len(self._free), "device free list holds a block twice"
        assert len(used) == len(used_ids), "a device block is used twice"
        assert not (free & used), f"device blocks both free and used: {sorted(free & used)[:8]}"
        assert len(free) + len(used) == self.num_blocks, (
            f"device blocks leak: {len(free)} free + {len(used)} used != {self.num_blocks}"
        )
