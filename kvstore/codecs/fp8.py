"""``fp8``: float8 e4m3 elements with one float32 scale per (layer, K/V, block, head).

The ``block_size x head_dim`` values of one head in one block share ``s = amax / 448``;
each element stores ``x / s`` rounded to the nearest e4m3 value, saturating at +-448 (e4m3fn
has no infinity). The error is at most 2**-4 of an element's magnitude, or ``s * 2**-10``
for elements in e4m3's subnormal range. 2x smaller than float16 (plus 4 bytes per head).
"""

from __future__ import annotations

import torch

from kvstore.codecs.header import SCALE_PER_BLOCK_HEAD
from kvstore.codecs.scaled import ScaledCodec

E4M3_MAX = 448.0


class Fp8Codec(ScaledCodec):
    name = "fp8"
    codec_id = 2
    scale_layout = SCALE_PER_BLOCK_HEAD
    element_dtype = torch.float8_e4m3fn

    def __init__(self) -> None:
        super().__init__(torch.float32)

    def scale_shape(self, block_shape: tuple[int, ...]) -> tuple[int, ...]:
        layers, kv, _block_size, heads, _head_dim = block_shape
        return (layers, kv, heads)

    def _amax(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().amax(dim=(3, 5))  # [c, layers, 2, heads]

    def _quantize(self, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        scales = amax / E4M3_MAX
        divisor = torch.where(scales > 0, scales, 1.0)
        x.div_(divisor[:, :, :, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
        return scales

    def _dequantize(self, scales: torch.Tensor, elements: torch.Tensor, out: torch.Tensor) -> None:
        values = e4m3_as_float16(elements).to(torch.float32)  # = e * 2**-8, exactly
        # One scale per row of head_dim values, materialised: a multiply by a contiguous
        # column runs twice as fast on the CPU as one broadcast over the block's tokens.
        block_size = elements.shape[3]
        column = (scales * 256.0)[:, :, :, None, :].expand(-1, -1, -1, block_size, -1).contiguous()
        out.copy_(values.mul_(column.unsqueeze(-1)))


def e4m3_as_float16(elements: torch.Tensor) -> torch.Tensor:
    """float8 e4m3fn values times 2**-8, exactly, as float16, with vectorised byte ops.

    torch converts float8 one element at a time on the CPU; this moves bits instead. e4m3's
    sign, 4 exponent bits and 3 mantissa bits become float16's sign, the low 4 of its 5
    exponent bits and its top 3 mantissa bits: float16 bits ``s << 15 | (e & 0x7f) << 7``.
    Both formats' subnormals line up too; e4m3fn's NaN (0x7f, 0xff) never occurs in an encoding.
    The byte is widened with its sign extended (``0x80 | m`` becomes ``0xff80 | m``), so after
    ``<< 7`` the sign sits in bits 15 and 14: clearing bit 14 leaves exactly those bits.
    """
    bits = elements.view(torch.int8).to(torch.int16)
    return bits.bitwise_left_shift_(7).bitwise_and_(-0x4001).view(torch.float16)
