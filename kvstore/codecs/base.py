"""The Codec interface: how a tier represents a block (docs/storage-format.md, "Codecs").

A codec is a representation, not an identity: the block key never depends on it. Every codec
has a fixed encoded size per KV layout, so a slot store sizes its slots once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from kvstore.errors import LayoutMismatchError
from kvstore.layout import KVLayout


class Codec(ABC):
    """Encodes ``[n, *block_shape]`` blocks into ``[n, encoded_bytes]`` uint8 rows and back.

    Geometry and dtype come from the tensors: ``encode`` reads them from ``blocks``, ``decode``
    from ``out``. Implementations are stateless and thread-safe.
    """

    name: ClassVar[str]
    """Registry name (``none``, ``int8``, ``int8-fp32``, ``fp8``, ``int4-rot``, ``int4-norot``)."""
    lossy: ClassVar[bool]
    """Whether ``decode(encode(x))`` may differ from ``x``."""

    @abstractmethod
    def encoded_bytes(self, layout: KVLayout) -> int:
        """Bytes of one encoded block of ``layout``; the same for every block.

        Raises:
            LayoutMismatchError: the codec cannot encode this layout's dtype.
        """

    @abstractmethod
    def encode(self, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Encode ``blocks`` (CPU ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]``).

        Args:
            blocks: the blocks; any float dtype the codec supports.
            out: optional uint8 ``[n, encoded_bytes]`` to write (rows may be strided, each row
                contiguous), e.g. reserved host slots.

        Returns:
            ``out`` (or a new tensor), every byte written, padding zeroed.

        Raises:
            LayoutMismatchError: wrong rank, dtype or ``out`` shape.
            CodecError: a block holds NaN or Inf, or a scale overflows its dtype; nothing of
                that block is usable (``out`` is then unspecified).
        """

    @abstractmethod
    def decode(self, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Decode ``src`` (uint8 ``[n, encoded_bytes]``, rows contiguous) into ``out``.

        Args:
            src: encoded rows, on the CPU or on ``out``'s device.
            out: contiguous ``[n, *block_shape]`` of the dtype the blocks were encoded from.

        Returns:
            ``out``.

        Raises:
            CodecFormatError: a row's header is not one this codec wrote for this geometry and
                dtype (message: which row, which field); ``out`` is then left unwritten.
            LayoutMismatchError: shapes or devices do not fit.
        """

    @abstractmethod
    def readable(self, src: torch.Tensor, layout: KVLayout) -> torch.Tensor:
        """Per row of ``src``: would ``decode`` accept it into a block of ``layout``?

        A bool ``[n]`` tensor; lets a reader turn refused blocks into misses before decoding.
        """

    def check_encodable(self, blocks: torch.Tensor) -> None:
        """Raise CodecError, naming the block, if ``encode`` would refuse any of ``blocks``
        (one pass over them; a store runs it at put, long before a demotion encodes)."""
        return None  # a lossless codec takes anything

    def prepare(self) -> None:
        """Get ready to encode and decode fast on this machine (a store calls it when a level
        with this codec opens; a build here may take a while, once per machine)."""
        return None

    def describe(self) -> dict[str, Any]:
        """What ``stats()``, REST and ``block_info`` say about the codec."""
        return {"codec": self.name, "lossy": self.lossy}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def check_src(src: torch.Tensor, num_bytes: int) -> int:
    """Check encoded rows ``[n, >= num_bytes]`` uint8 with contiguous rows; return ``n``."""
    if not isinstance(src, torch.Tensor) or src.dtype != torch.uint8 or src.dim() != 2:
        raise LayoutMismatchError(
            f"encoded blocks must be a uint8 tensor [n, {num_bytes}], got "
            f"{getattr(src, 'dtype', type(src).__name__)} {tuple(getattr(src, 'shape', ()))}"
        )
    if src.shape[1] != num_bytes or (num_bytes > 1 and src.stride(1) != 1):
        raise LayoutMismatchError(
            f"encoded blocks have shape {tuple(src.shape)} strides {src.stride()}; expected [n, {num_bytes}] "
            "with contiguous rows"
        )
    return src.shape[0]


def check_blocks(blocks: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> KVLayout:
    """Check ``[n, L, 2, B, H, D]`` blocks of one of ``dtypes``; return their geometry as a layout."""
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 6 or blocks.shape[2] != 2:
        raise LayoutMismatchError(
            f"blocks must be a tensor [n, num_layers, 2, block_size, num_kv_heads, head_dim], got "
            f"{tuple(getattr(blocks, 'shape', ()))}"
        )
    if blocks.dtype not in dtypes:
        raise LayoutMismatchError(f"blocks have dtype {blocks.dtype}; this codec takes {[str(d) for d in dtypes]}")
    layers, _kv, block_size, heads, head_dim = blocks.shape[1:]
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, block_size=block_size,
                    dtype=blocks.dtype)


def check_out(out: torch.Tensor | None, n: int, num_bytes: int) -> torch.Tensor:
    """The uint8 ``[n, num_bytes]`` an encode writes: ``out`` checked, or a new tensor."""
    if out is None:
        return torch.empty((n, num_bytes), dtype=torch.uint8)
    if check_src(out, num_bytes) != n:
        raise LayoutMismatchError(f"encode got {n} blocks but out has {out.shape[0]} rows")
    return out
