"""``none``: the block's own bytes, no header (what every tier held before codecs)."""

from __future__ import annotations

import torch

from kvstore.codecs.base import Codec, check_blocks, check_out, check_src
from kvstore.errors import LayoutMismatchError
from kvstore.layout import DTYPE_NAMES, KVLayout


class RawCodec(Codec):
    """Identity: ``encoded_bytes`` is ``bytes_per_block`` and the rows are the blocks' bytes.

    Having no header, a raw row cannot be told from another codec's; tiers keep raw and
    encoded blocks apart by their slot size (docs/storage-format.md).
    """

    name = "none"
    lossy = False

    def encoded_bytes(self, layout: KVLayout) -> int:
        return layout.bytes_per_block

    def encode(self, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        layout = check_blocks(blocks, tuple(DTYPE_NAMES))
        n = blocks.shape[0]
        out = check_out(out, n, layout.bytes_per_block)
        if n:
            out.copy_(blocks.detach().contiguous().view(torch.uint8).view(n, -1))
        return out

    def decode(self, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        layout = check_blocks(out, tuple(DTYPE_NAMES))
        n = check_src(src, layout.bytes_per_block)
        if n != out.shape[0] or (n > 0 and not out[0].is_contiguous()):
            raise LayoutMismatchError(f"decode of {n} rows needs an out of {n} contiguous blocks, got "
                                      f"{tuple(out.shape)} strides {out.stride()}")
        if n:
            out.flatten(1).view(torch.uint8).copy_(src)
        return out

    def readable(self, src: torch.Tensor, layout: KVLayout) -> torch.Tensor:
        check_src(src, layout.bytes_per_block)
        return torch.ones(src.shape[0], dtype=torch.bool, device=src.device)
