"""``fp8``: float8 e4m3 elements with one float32 scale per (layer, K/V, block, head).

The ``block_size x head_dim`` values of one head in one block share ``s = amax / 448``;
each element stores ``x / s`` rounded to the nearest e4m3 value, saturating at +-448 (e4m3fn
has no infinity). The error is at most 2**-4 of an element's magnitude, or ``s * 2**-10``
for elements in e4m3's subnormal range. 2x smaller than float16 (plus 4 bytes per head).
"""

from __future__ import annotations

import torch

from kvstore import kernels
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
        # One scale per row of head_dim values, materialised: the kernels take one per row, and
        # on the CPU a multiply by a contiguous column runs twice as fast as a broadcast over
        # the block's tokens. Then rows [n, layers * 2 * block_size * heads, head_dim].
        n, block_size, head_dim = elements.shape[0], elements.shape[3], elements.shape[-1]
        column = scales[:, :, :, None, :].expand(-1, -1, -1, block_size, -1).reshape(n, -1)
        kernels.dequantize_fp8(elements.reshape(n, -1, head_dim), column, out.view(n, -1, head_dim))

