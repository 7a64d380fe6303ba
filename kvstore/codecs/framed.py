"""The frame every quantizing codec shares: header | scales | elements | zeros.

Encoded block (docs/storage-format.md, "Codecs")::

    [0, 32)          header (kvstore.codecs.header)
    [32, 32 + S)     scales, scale dtype, C order over the codec's scale shape
    [32 + S, +N)     the elements: one byte per value (int8, fp8) or two codes a byte (int4)
    [.., E)          zeros up to E, a multiple of 16

Encoding and decoding run over chunks of a few blocks, so the float32 temporaries stay in the
CPU's caches. A subclass says how a chunk is quantized and dequantized, and how many bytes its
elements take; the header, the views, the checks and the chunk loops are here, once.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Any, ClassVar

import torch

from kvstore import kernels
from kvstore.codecs.base import Codec, check_blocks, check_out, check_src
from kvstore.codecs.header import HEADER_BYTES, BlockHeader, encoded_size, mismatch, rows_matching
from kvstore.errors import CodecError, CodecFormatError, LayoutMismatchError
from kvstore.kernels import cpu_ext
from kvstore.layout import KVLayout

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CHUNK_ELEMENTS = 1 << 20  # elements per CPU chunk: 4 MiB of float32 temporaries


class FramedCodec(Codec):
    """A lossy codec of scales and quantized elements in the shared frame."""

    lossy = True
    codec_id: ClassVar[int]
    version: ClassVar[int] = 1
    scale_layout: ClassVar[int]
    scale_dtype: torch.dtype
    max_amax: ClassVar[float] = float("inf")  # the largest |x| whose scale the scale dtype holds

    @abstractmethod
    def scale_shape(self, block_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one block's scales."""

    @abstractmethod
    def element_bytes(self, layout: KVLayout) -> int:
        """Bytes of one block's elements."""

    @abstractmethod
    def _elements(self, raw: torch.Tensor, layout: KVLayout) -> torch.Tensor:
        """The elements of encoded rows, as the codec reads and writes them, viewing ``raw``
        (uint8 ``[n, element_bytes]``)."""

    @abstractmethod
    def _encode_chunk(self, x: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scales, elements)`` of float32 blocks ``x`` (blocks ``first`` to ``first + len(x)``
        of the encode, a copy the codec may overwrite); raises CodecError naming the block for
        NaN, Inf, or a value whose scale the scale dtype cannot hold."""

    @abstractmethod
    def _dequantize(self, scales: torch.Tensor, elements: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` = the values of ``elements`` times ``scales``, in ``out``'s dtype."""

    # ---------------------------------------------------------------------------- format

    def header(self, layout: KVLayout) -> BlockHeader:
        """The header every block of ``layout`` carries under this codec."""
        if layout.dtype not in FLOAT_DTYPES:
            raise LayoutMismatchError(f"{self.name} encodes {[str(d) for d in FLOAT_DTYPES]} blocks, "
                                      f"not {layout.dtype}")
        scale_bytes = math.prod(self.scale_shape(layout.block_shape)) * self.scale_dtype.itemsize
        return BlockHeader(self.codec_id, self.version, layout.dtype, self.scale_dtype, self.scale_layout,
                           layout.block_shape, scale_bytes + self.element_bytes(layout))

    def encoded_bytes(self, layout: KVLayout) -> int:
        return encoded_size(self.header(layout).body_bytes)

    def prepare(self) -> None:
        """Build the C++ CPU decode kernels (kvstore.kernels.cpu_ext): a CPU decode then runs
        one pass over the codes, several times faster than the torch path it keeps otherwise."""
        cpu_ext.load()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "version": self.version, "scale_dtype": str(self.scale_dtype).split(".")[-1]}

    def _views(self, rows: torch.Tensor, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scales [n, *scale_shape], elements)`` viewing encoded rows."""
        n = rows.shape[0]
        shape = self.scale_shape(layout.block_shape)
        scale_end = HEADER_BYTES + math.prod(shape) * self.scale_dtype.itemsize
        scales = rows[:, HEADER_BYTES:scale_end]
        if scales.storage_offset() % self.scale_dtype.itemsize or rows.stride(0) % self.scale_dtype.itemsize:
            raise LayoutMismatchError(f"encoded rows at byte offset {rows.storage_offset()} stride "
                                      f"{rows.stride(0)} do not align {self.scale_dtype} scales")
        elements = self._elements(rows[:, scale_end : scale_end + self.element_bytes(layout)], layout)
        return scales.view(self.scale_dtype).view(n, *shape), elements

    def _one_pass(self, layout: KVLayout) -> bool:
        """Whether a CPU decode of ``layout`` runs the C++ kernel (no temporaries to bound)."""
        return cpu_ext.loaded() is not None and kernels.kernel_backend() == "auto"

    def _chunk(self, layout: KVLayout) -> int:
        return max(1, CHUNK_ELEMENTS // layout.elements_per_block)

    # ---------------------------------------------------------------------------- encode

    def encode(self, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        layout = check_blocks(blocks, FLOAT_DTYPES)
        header = self.header(layout)
        n, size = blocks.shape[0], encoded_size(header.body_bytes)
        out = check_out(out, n, size)
        if n == 0:
            return out
        out[:, :HEADER_BYTES].copy_(torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8))
        out[:, HEADER_BYTES + header.body_bytes :].zero_()
        scales, elements = self._views(out, layout)
        chunk = self._chunk(layout)
        for start in range(0, n, chunk):
            x = blocks[start : start + chunk].detach().to("cpu", torch.float32, copy=True)
            chunk_scales, chunk_elements = self._encode_chunk(x, start)
            scales[start : start + chunk].copy_(chunk_scales)
            elements[start : start + chunk].copy_(chunk_elements)
        return out

    # ---------------------------------------------------------------------------- decode

    def readable(self, src: torch.Tensor, layout: KVLayout) -> torch.Tensor:
        header = self.header(layout)
        check_src(src, encoded_size(header.body_bytes))
        return rows_matching(src, header.pack())

    def decode(self, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        layout = check_blocks(out, FLOAT_DTYPES)
        n = src.shape[0] if isinstance(src, torch.Tensor) else -1
        if n != out.shape[0] or (n > 0 and not out[0].is_contiguous()):
            raise LayoutMismatchError(f"decode of {n} rows needs an out of {n} contiguous blocks, got "
                                      f"{tuple(out.shape)} strides {out.stride()}")
        ok = self.readable(src, layout)
        if n and not bool(ok.all()):
            first = int((~ok).nonzero()[0])
            raw = bytes(src[first, :HEADER_BYTES].cpu().numpy())
            raise CodecFormatError(f"encoded block {first} of {n} is refused by {self.name}: "
                                   f"{mismatch(raw, self.header(layout))}")
        if n == 0:
            return out
        if src.device != out.device:
            src = src.to(out.device, non_blocking=True)
        scales, elements = self._views(src, layout)
        # chunks bound the torch path's float32 temporaries; a GPU and the C++ kernel make none
        chunk = n if out.device.type != "cpu" or self._one_pass(layout) else self._chunk(layout)
        for start in range(0, n, chunk):
            stop = start + chunk
            self._dequantize(scales[start:stop], elements[start:stop], out[start:stop])
        return out


def check_finite(x: torch.Tensor, first: int, codec: str) -> None:
    """Raise CodecError naming the first block of ``x`` (numbered from ``first``) with NaN/Inf."""
    finite = torch.isfinite(x).view(x.shape[0], -1).all(dim=1)
    if bool(finite.all()):
        return
    i = int((~finite).nonzero()[0])
    block = x[i]
    num_nan, num_inf = int(block.isnan().sum()), int(block.isinf().sum())
    layer, kv, token, head, dim = (int(v) for v in (~torch.isfinite(block)).nonzero()[0])
    raise CodecError(f"block {first + i} holds {num_nan} NaN and {num_inf} Inf values (first at layer {layer}, "
                     f"{'KV'[kv]}, token {token}, head {head}, dim {dim}); {codec} cannot encode them")
