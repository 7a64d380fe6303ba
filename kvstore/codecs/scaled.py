"""The scaled 8-bit codecs (int8, fp8): one byte per value times a float scale shared by a
group of values, in the frame of kvstore/codecs/framed.py (header | scales | elements | zeros,
the elements C order over [num_layers, 2, block_size, kv_heads, head_dim]).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch

from kvstore.codecs.framed import FramedCodec, check_finite
from kvstore.errors import CodecError
from kvstore.layout import KVLayout


class ScaledCodec(FramedCodec):
    """An 8-bit element per value times a float scale shared by a group of values."""

    element_dtype: ClassVar[torch.dtype]

    def __init__(self, scale_dtype: torch.dtype) -> None:
        self.scale_dtype = scale_dtype

    @abstractmethod
    def _amax(self, x: torch.Tensor) -> torch.Tensor:
        """max |x| over each scale group of float32 blocks ``x`` (NaN where one is NaN)."""

    @abstractmethod
    def _quantize(self, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """Turn float32 blocks ``x`` (finite) in place into the values their elements store;
        return the scales, in ``scale_dtype``, derived from ``amax``."""

    def element_bytes(self, layout: KVLayout) -> int:
        return layout.elements_per_block

    def _elements(self, raw: torch.Tensor, layout: KVLayout) -> torch.Tensor:
        return raw.view(self.element_dtype).view(raw.shape[0], *layout.block_shape)

    def _encode_chunk(self, x: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        amax = self._amax(x)
        if not bool(torch.isfinite(amax).all()):  # amax carries any NaN or Inf of its group
            check_finite(x, first, self.name)
        return self._quantize(x, amax), x

    def check_encodable(self, blocks: torch.Tensor) -> None:
        n = blocks.shape[0]
        if n == 0:
            return
        amax = blocks.detach().abs().reshape(n, -1).amax(dim=1).float()
        bad = ~(amax <= self.max_amax)  # NaN compares false: caught here too
        if not bool(bad.any()):
            return
        i = int(bad.nonzero()[0])
        check_finite(blocks[i : i + 1].float(), i, self.name)
        raise CodecError(f"block {i} has values up to {float(amax[i]):.4g}; {self.name} holds at most "
                         f"{self.max_amax:.4g} (its {self.scale_dtype} scales overflow)")
