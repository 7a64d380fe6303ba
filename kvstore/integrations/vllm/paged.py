"""vLLM's paged KV (one tensor per layer) <-> kvstore blocks (every layer of one vLLM block).

A kvstore block here is ``[num_layers, layer_bytes]``: slot l's part is vLLM block b of the
layer in slot l (a hybrid model's: of the block's KV group), byte for byte, whatever order the
attention backend keeps inside a block (the CPU backend stores K transposed). A copy is one gather or scatter per layer over all the blocks
of a load or a save (kernels.gather_blocks / scatter_blocks: Triton on CUDA, torch on CPU).

Staging buffers are gathered into and scattered from inside vLLM's forward, so they are
reused: a fresh one faults in every page there (a 2,048-token save of the bench model: 165 ms
of gathers per step into fresh buffers, 21 ms into warm ones). Up to SPARE_BYTES of them wait
between steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvstore import kernels
from kvstore.errors import LayoutMismatchError
from kvstore.layout import KVLayout
from kvstore.store.buffer_pool import BufferPool

SPARE_BYTES = 1 << 30  # staging buffers kept warm between steps, in all


class PagedKV:
    """The registered vLLM caches of one worker, viewed as ``[num_blocks, layer_elems]`` each."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], layer_names: Sequence[str], layout: KVLayout,
                 layer_bytes: int, slots: Mapping[str, int] | None = None) -> None:
        """``slots``: each layer's slot in a block (default: its place in ``layer_names``). A
        hybrid model's layers of different groups share slots, and may share memory too
        (vLLM's hybrid allocator: a block id belongs to one group at a time)."""
        missing = [n for n in layer_names if n not in kv_caches]
        if missing:
            raise LayoutMismatchError(f"vLLM registered no KV cache for layers {missing[:3]}")
        self.layout = layout
        self.layer_elems = layer_bytes // layout.dtype.itemsize
        self.layers: dict[str, torch.Tensor] = {}
        for name in layer_names:
            kv = kv_caches[name]
            if kv.dtype != layout.dtype:
                raise LayoutMismatchError(f"layer {name} caches {kv.dtype}, the layout says {layout.dtype}")
            if not kv[0].is_contiguous() or kv[0].numel() != self.layer_elems:
                raise LayoutMismatchError(
                    f"layer {name}: a block of shape {tuple(kv.shape[1:])}, strides {kv.stride()} is not one "
                    f"contiguous payload of {self.layer_elems} elements; this backend's layout is not supported")
            self.layers[name] = kv.view(kv.shape[0], self.layer_elems) if kv.is_contiguous() else \
                kv.as_strided((kv.shape[0], self.layer_elems), (kv.stride(0), 1))
        self.layer_index = dict(slots) if slots is not None else {name: i for i, name in enumerate(layer_names)}
        bad = {n: i for n, i in self.layer_index.items() if not 0 <= i < layout.num_layers}
        if bad or set(self.layer_index) != set(layer_names):
            raise LayoutMismatchError(f"layer slots {bad or self.layer_index} do not fit the layout's "
                                      f"{layout.num_layers} slots for layers {list(layer_names)[:3]}...")
        first = next(iter(self.layers.values()))
        self.device = first.device
        self.num_blocks = first.shape[0]
        self._spares = BufferPool(self.staging, SPARE_BYTES)  # taken on vLLM's thread, given back on others too

    def staging(self, num_blocks: int) -> torch.Tensor:
        """A host buffer of ``num_blocks`` kvstore blocks (pinned when the cache is on CUDA).

        Made outside inference mode: the store's transfer threads write it, and a tensor made
        inside vLLM's forward would be an inference tensor they may not update in place.
        """
        with torch.inference_mode(False):
            return torch.empty((num_blocks, *self.layout.block_shape), dtype=self.layout.dtype,
                               pin_memory=self.device.type == "cuda")

    def take_staging(self, num_blocks: int) -> torch.Tensor:
        """A staging buffer of at least ``num_blocks`` blocks (use its first
        ``num_blocks``): the smallest warm one that fits, else a new one. The caller hands it
        back with ``give_staging`` once nothing reads or writes it any more."""
        return self._spares.take(num_blocks)

    def give_staging(self, buf: torch.Tensor) -> None:
        """Keep ``buf`` (from ``take_staging``) warm for a later load or save, within SPARE_BYTES."""
        self._spares.give(buf)

    def _rows(self, staging: torch.Tensor, layer: str) -> torch.Tensor:
        """Layer ``layer``'s slot of each staged block: ``[n, layer_elems]``, rows contiguous."""
        return staging.view(staging.shape[0], self.layout.num_layers, self.layer_elems)[:, self.layer_index[layer]]

    def gather_layer(self, layer: str, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
        """``staging[i]``'s part of ``layer`` = vLLM block ``block_ids[i]`` of that layer."""
        pool, rows = self.layers[layer], self._rows(staging, layer)
        if pool.device.type == "cpu":
            kernels.gather_blocks(pool, block_ids, rows)
        else:
            rows.copy_(kernels.gather_blocks(pool, block_ids.to(pool.device)))

    def scatter_layer(self, layer: str, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
        """vLLM block ``block_ids[i]`` of ``layer`` = ``staging[i]``'s part of that layer."""
        if block_ids.numel() == 0:
            return
        pool, rows = self.layers[layer], self._rows(staging[: block_ids.numel()], layer)
        kernels.scatter_blocks(pool, block_ids.to(pool.device), rows.to(pool.device))
