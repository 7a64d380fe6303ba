"""``int4-rot`` and ``int4-norot``: 4-bit codes, two per byte, with one float16 scale per group
of ``GROUP`` values along head_dim; ``int4-rot`` first turns each head row by a fixed
orthogonal matrix (kvstore/codecs/rotation.py), ``int4-norot`` (the ablation) does not.

Encoded block (docs/storage-format.md, "Codecs")::

    [0, 32)          header (kvstore.codecs.header), scale layout SCALE_PER_HEAD_GROUP
    [32, 32 + S)     float16 scales, C order over [layers, 2, block_size, kv_heads, groups]
    [32 + S, +E/2)   codes, C order over [layers, 2, block_size, kv_heads, head_dim] of the
                     (rotated) values, code 2i in the low nibble of byte i, 2i+1 in the high
    [.., end)        zeros up to a multiple of 16

A head row (rotated for ``int4-rot``: ``y = x @ M``) is cut into groups of ``GROUP`` values,
the last one shorter when head_dim is not a multiple. Each group stores ``s = max|y| / 7.5``
rounded *up* to float16, and each value the code ``c = clamp(floor(y / s), -8, 7) + 8``; a
code decodes to ``(c - 7.5) * s``: 16 levels symmetric about zero, none clipped. So a stored
value is off by at most ``s / 2`` (about max|y| / 15) before the rotation is undone
(``x = y @ M.T``); after it, the row's error has the same L2 norm, at most
``sqrt(sum over groups of n_g (s_g / 2)**2)``, and so has each of its elements.

At head_dim a multiple of 64 that is 4 + 16/64 = 4.25 bits per value, scales included (4.5 at
head_dim 32, 5 at 16); groups of 32 measured better but take 4.5 bits, and a 4 KiB page more
per block at SmolLM2's and the benchmark's layouts (docs/storage-format.md).
"""

from __future__ import annotations

import math
import sys
from typing import Any, ClassVar

import torch

from kvstore import kernels
from kvstore.codecs.framed import FramedCodec, check_finite
from kvstore.codecs.header import SCALE_PER_HEAD_GROUP
from kvstore.codecs.rotation import rotation, rotation_name
from kvstore.errors import CodecError
from kvstore.kernels import cpu_ext
from kvstore.layout import KVLayout

GROUP = 64  # values of a head row that share a scale (chosen by measurement: docs/storage-format.md)
HALF_LEVELS = 7.5  # codes 0..15 decode to (c - 7.5) * s
SCALE_DTYPE = torch.float16


class Int4Codec(FramedCodec):
    """4-bit codes, float16 scales per group of ``GROUP`` along head_dim, no rotation."""

    name = "int4-norot"
    codec_id: ClassVar[int] = 4
    scale_layout: ClassVar[int] = SCALE_PER_HEAD_GROUP
    scale_dtype = SCALE_DTYPE
    rotated: ClassVar[bool] = False
    max_amax: ClassVar[float] = 65504.0 * HALF_LEVELS  # a larger group max needs a scale past float16's

    @staticmethod
    def num_groups(head_dim: int) -> int:
        return -(-head_dim // GROUP)

    def scale_shape(self, block_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one block's scales: ``[layers, 2, block_size, kv_heads, groups]``."""
        return (*block_shape[:-1], self.num_groups(block_shape[-1]))

    def element_bytes(self, layout: KVLayout) -> int:
        return layout.elements_per_block // 2  # two codes a byte; elements_per_block is even: K and V

    def _elements(self, raw: torch.Tensor, layout: KVLayout) -> torch.Tensor:
        return raw  # packed codes, uint8 [n, elements / 2]

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "group": GROUP, "rotated": self.rotated}

    def _one_pass(self, layout: KVLayout) -> bool:
        return super()._one_pass(layout) and _cpp_applies(layout.head_dim, self.rotated)

    # ---------------------------------------------------------------------------- encode

    def _groups(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 blocks ``x`` ``[c, *block_shape]`` as (rotated) groups ``[c, rows, groups, GROUP]``:
        a new tensor, the last group of a row zero-padded when head_dim is not a multiple."""
        c, head_dim = x.shape[0], x.shape[-1]
        rows = x.view(c, -1, head_dim)
        if self.rotated:  # one 2-D product: a batched one runs several times slower on the CPU
            rows = torch.mm(rows.view(-1, head_dim), rotation(head_dim)).view(rows.shape)
        width = self.num_groups(head_dim) * GROUP
        if width != head_dim:
            rows = torch.nn.functional.pad(rows, (0, width - head_dim))
        return rows.view(c, rows.shape[1], -1, GROUP)

    def _encode_chunk(self, x: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales (float16 ``[c, *scale_shape]``) and packed codes (uint8 ``[c, elements / 2]``) of
        float32 blocks ``x`` (blocks ``first`` to ``first + c`` of the encode)."""
        c, head_dim = x.shape[0], x.shape[-1]
        groups = self._groups(x)
        amax = groups.abs().amax(dim=-1)  # NaN or Inf where a block holds one
        if not bool((amax <= self.max_amax).all()):
            self._refuse(x, amax, first)
        scales = _round_up(amax / HALF_LEVELS)
        divisor = torch.where(scales > 0, scales.float(), 1.0)  # a zero group stays code 8: 0
        groups.div_(divisor.unsqueeze(-1)).floor_().clamp_(-8, 7).add_(8)
        codes = groups.view(c, groups.shape[1], -1)[..., :head_dim]
        codes = codes.to(torch.int8, memory_format=torch.contiguous_format)  # to uint8 is several times slower
        return scales.view(c, *self.scale_shape(tuple(x.shape[1:]))), _pack(codes.view(c, -1))

    def _refuse(self, x: torch.Tensor, amax: torch.Tensor, first: int) -> None:
        """Raise CodecError for the first block of ``x`` with NaN/Inf, or whose scale overflows."""
        check_finite(x, first, self.name)
        worst = amax.view(x.shape[0], -1).amax(dim=1)
        i = int((worst > self.max_amax).nonzero()[0])
        raise CodecError(f"block {first + i} has a group of {self.name} values up to {float(worst[i]):.4g}; its "
                         f"float16 scale holds groups up to {self.max_amax:.4g}")

    def check_encodable(self, blocks: torch.Tensor) -> None:
        n = blocks.shape[0]
        if n == 0:
            return
        amax = blocks.detach().abs().reshape(n, -1).amax(dim=1).float()
        # A rotated value is at most its row's norm, sqrt(head_dim) times the row's largest
        # (the float32 rotation's rounding aside): below that limit no scale can overflow.
        limit = self.max_amax / (math.sqrt(blocks.shape[-1]) * (1 + 1e-5) if self.rotated else 1.0)
        for i in (~(amax <= limit)).nonzero().flatten().tolist():  # rare: NaN, Inf or huge values
            x = blocks[i : i + 1].detach().to("cpu", torch.float32, copy=True)
            self._encode_chunk(x, i)

    # ---------------------------------------------------------------------------- decode

    def _dequantize(self, scales: torch.Tensor, packed: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` = the values of codes ``packed`` times ``scales`` (rotated back), in out's dtype."""
        c, head_dim = out.shape[0], out.shape[-1]
        num_groups = self.num_groups(head_dim)
        if _cpp_dequantize(packed, scales.reshape(c, -1, num_groups), out.view(c, -1, head_dim), self.rotated):
            return
        values = _unpack(packed).view(c, -1, head_dim)
        width = num_groups * GROUP
        if width != head_dim:
            values = torch.nn.functional.pad(values, (0, width - head_dim))
        values = values.view(c, values.shape[1], num_groups, GROUP).sub_(HALF_LEVELS)
        values.mul_(scales.reshape(c, -1, num_groups, 1).float())
        rows = values.view(-1, width)[:, :head_dim]
        target = out.view(-1, head_dim)
        if not self.rotated:
            target.copy_(rows)
        elif target.dtype == torch.float32:
            torch.mm(rows, rotation(head_dim).to(rows.device).T, out=target)
        else:
            target.copy_(torch.mm(rows, rotation(head_dim).to(rows.device).T))


class Int4RotCodec(Int4Codec):
    """``Int4Codec`` over head rows turned by the fixed rotation of their head_dim."""

    name = "int4-rot"
    codec_id = 3
    rotated = True


# Packing goes through int16 views of byte pairs, so it needs a little-endian host (as the
# scales' float16 views already do): one pass each way instead of strided byte slices.
assert sys.byteorder == "little", "int4 packing reads byte pairs as little-endian int16"


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes ``[c, e]`` (0..15, ``e`` even) -> uint8 ``[c, e / 2]``: ``codes[2i] | codes[2i + 1] << 4``."""
    pairs = codes.view(torch.int16)  # codes[2i] + 256 * codes[2i + 1]
    return (pairs | (pairs >> 4)).to(torch.int8).view(torch.uint8)  # the low byte: lo | hi << 4


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[c, e / 2]`` -> the float32 codes ``[c, e]`` (0..15), ``_pack`` undone."""
    pairs = packed.to(torch.int16, memory_format=torch.contiguous_format)
    return ((pairs & 15) | ((pairs << 4) & 0xF00)).view(torch.int8).float()


def _cpp_applies(head_dim: int, rotated: bool) -> bool:
    """Whether the C++ kernel (kvstore/kernels/csrc/dequantize.cpp) decodes this head_dim on the
    CPU: ``KVSTORE_KERNELS=auto``, an even head_dim, and for a rotation a power-of-two one (the
    Hadamard rotation, undone by the fast transform)."""
    return not head_dim % 2 and (not rotated or rotation_name(head_dim) == "hadamard") \
        and kernels.kernel_backend() == "auto"


def _cpp_dequantize(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, rotated: bool) -> bool:
    """Decode through the C++ kernel where it applies (CPU tensors, ``_cpp_applies``, the kernels loaded)."""
    if out.device.type != "cpu" or not _cpp_applies(out.shape[-1], rotated):
        return False
    module = cpu_ext.loaded()
    if module is None:
        return False
    module.dequantize_int4(packed, scales, out, rotated)
    return True


def _round_up(scales: torch.Tensor) -> torch.Tensor:
    """Float32 ``scales`` (finite, >= 0, at most 65504) in float16, each rounded to the nearest
    value not below it."""
    stored = scales.to(SCALE_DTYPE)
    low = stored.float() < scales
    if bool(low.any()):
        # For positive floats the next larger value is the next bit pattern.
        stored = stored.view(torch.int16).add_(low.to(torch.int16)).view(SCALE_DTYPE)
    return stored


__all__ = ["GROUP", "Int4Codec", "Int4RotCodec"]
