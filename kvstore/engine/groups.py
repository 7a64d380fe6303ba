"""The engine's KV groups: how a device block (every layer of one token block) maps onto the
store's per-group blocks, and which boundary a prefix hit may end at.

The device pool keeps every layer of a token block in one device block, as for any model. A
hybrid model's store keeps a block per KV group instead (kvstore/layout.py: Gemma 3's five
sliding-window groups and one full group of three layers each), so the engine moves group g's
layers of a device block to and from the store under group g's key (``gather``/``scatter``).
A device block filled from the store may hold only some groups' layers (a sliding group's
block below the hit's window is never fetched): ``Block.valid`` (kvstore/engine/block_manager.py)
says which, and a hit never needs more than what is valid.

**What a hit at boundary n needs** (n blocks cached, the next token at position n x block_size):
full attention, group g's blocks 0 ... n - 1; a sliding window of W tokens, only its
``cdiv(W - 1, block_size)`` blocks ending at n (``needs``). ``reconcile`` finds the longest
boundary at which every group has what it needs: never a false hit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvstore.layout import FULL, KVGroup, KVLayout


class DeviceGroups:
    """The store layout's KV groups, seen from a device pool of ``num_layers`` layers.

    Args:
        layout: the store's layout (its ``kv_groups``; ``num_layers`` = a group's layer slots).
        num_layers: the model's layer count (the device pool's second dimension).
    """

    def __init__(self, layout: KVLayout, num_layers: int) -> None:
        self.layout = layout
        self.groups: tuple[KVGroup, ...] = layout.kv_groups
        self.num_groups = len(self.groups)
        # one group of every layer in order: device blocks are the store's blocks (today's path)
        self.trivial = not layout.groups and layout.num_layers == num_layers
        self.all_groups = (1 << self.num_groups) - 1
        self.windows: list[int | None] = [g.window_blocks(layout.block_size) for g in self.groups]
        self.full_groups = [g for g, group in enumerate(self.groups) if group.kind == FULL]
        self.sliding_groups = [g for g, group in enumerate(self.groups) if group.kind != FULL]
        self._layers = [torch.tensor(g.layers, dtype=torch.long) for g in self.groups]
        used = sorted(i for g in self.groups for i in g.layers)
        if used != list(range(num_layers)):
            raise ValueError(f"the layout's groups name layers {used}, the model has {num_layers}")

    def needs(self, n: int, i: int) -> int:
        """The groups (a bitmask) whose block ``i`` a hit at boundary ``n`` (> i) needs."""
        mask = 0
        for g, w in enumerate(self.windows):
            if w is None or i >= n - w:
                mask |= 1 << g
        return mask

    def reconcile(self, n_max: int, present: Callable[[int, int], bool]) -> int:
        """The longest boundary ``n <= n_max`` at which every group has what a hit needs:
        ``present(g, i)`` says whether group g's block i can be had (on the device or in the
        store). 0 when no block can be used."""
        n = n_max
        for g in self.full_groups:
            run = 0
            while run < n and present(g, run):
                run += 1
            n = run
        while n > 0:
            missing = -1  # the last block some sliding window before n lacks
            for g in self.sliding_groups:
                w = self.windows[g]
                assert w is not None
                for i in range(n - 1, max(0, n - w) - 1, -1):
                    if not present(g, i):
                        missing = max(missing, i)
                        break
            if missing < 0:
                return n
            n = missing  # a window ending at or before the missing block
        return 0

    def window_start(self, g: int, n: int) -> int:
        """The first block of group ``g`` a hit at boundary ``n`` needs (0 for full attention)."""
        w = self.windows[g]
        return 0 if w is None else max(0, n - w)

    def gather(self, pool: torch.Tensor, block_ids: Sequence[int], g: int) -> torch.Tensor:
        """Group ``g``'s blocks of device blocks ``block_ids``: ``[n, *layout.block_shape]``, a
        copy (its last layer slots zero where the group is padded)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
        if self.trivial:
            return pool.index_select(0, ids)
        layers = self._layers[g].to(pool.device)
        rows = pool.index_select(0, ids).index_select(1, layers)
        slots = self.layout.num_layers
        if rows.shape[1] == slots:
            return rows
        out = torch.zeros((len(block_ids), slots, *rows.shape[2:]), dtype=pool.dtype, device=pool.device)
        out[:, : rows.shape[1]] = rows
        return out

    def scatter(self, pool: torch.Tensor, block_ids: Sequence[int], g: int, blocks: torch.Tensor) -> None:
        """Write group ``g``'s blocks ``blocks`` (``[n, *layout.block_shape]``) into device blocks
        ``block_ids``' layers of that group."""
        if not block_ids:
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
        blocks = blocks.to(pool.device)
        if self.trivial:
            pool.index_copy_(0, ids, blocks)
            return
        layers = self._layers[g].to(pool.device)
        for j, layer in enumerate(layers.tolist()):
            pool[:, layer].index_copy_(0, ids, blocks[:, j])
