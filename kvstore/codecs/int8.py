"""``int8``: symmetric int8 with one absmax scale per (layer, K/V, token, head).

Each head row of ``head_dim`` values ``x`` becomes ``q = round(x / s)`` in [-127, 127] with
``s = amax(|x|) / 127`` stored in float16 (``int8``) or float32 (``int8-fp32``). A float16
scale is rounded *up*, so no value clips and the error stays ``<= s / 2``: at most amax / 254,
times (1 + 2**-10) for the float16 scale's rounding, plus 2**-25 where that scale is
subnormal. A zero row has scale 0 and decodes to zeros. At head dim 64 and float16 blocks a
row is 64 + 2 bytes instead of 128 (1.94x smaller).
"""

from __future__ import annotations

import torch

from kvstore import kernels
from kvstore.codecs.header import SCALE_PER_TOKEN_HEAD
from kvstore.codecs.scaled import ScaledCodec
from kvstore.errors import CodecError

QMAX = 127


class Int8Codec(ScaledCodec):
    """int8 elements, float16 scales."""

    name = "int8"
    codec_id = 1
    scale_layout = SCALE_PER_TOKEN_HEAD
    element_dtype = torch.int8
    default_scale_dtype = torch.float16
    max_amax = 65504.0 * QMAX  # a larger amax needs a scale past float16's largest value

    def __init__(self) -> None:
        super().__init__(self.default_scale_dtype)

    def scale_shape(self, block_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(block_shape[:-1])  # [layers, 2, block_size, kv_heads]

    def _amax(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().amax(dim=-1)

    def _quantize(self, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        scales = _round_up(amax / QMAX, self.scale_dtype, self.name)
        divisor = scales.float()
        divisor = torch.where(divisor > 0, divisor, 1.0)  # a zero row stays zeros
        x.div_(divisor.unsqueeze(-1)).round_().clamp_(-QMAX, QMAX)
        return scales

    def _dequantize(self, scales: torch.Tensor, elements: torch.Tensor, out: torch.Tensor) -> None:
        n, head_dim = out.shape[0], out.shape[-1]
        kernels.dequantize_int8(elements.reshape(n, -1, head_dim), scales.reshape(n, -1),
                                out.view(n, -1, head_dim))


class Int8Fp32Codec(Int8Codec):
    """int8 elements, float32 scales: for bfloat16/float32 blocks whose amax passes 8e6."""

    name = "int8-fp32"
    default_scale_dtype = torch.float32
    max_amax = float("inf")


def _round_up(scales: torch.Tensor, dtype: torch.dtype, codec: str) -> torch.Tensor:
    """``scales`` (float32, >= 0) in ``dtype``, each rounded to the nearest value not below it."""
    if dtype == torch.float32:
        return scales
    stored = scales.to(dtype)
    low = stored.float() < scales
    if bool(low.any()):
        # For positive floats the next larger value is the next bit pattern.
        stored = stored.view(torch.int16).add_(low.to(torch.int16)).view(dtype)
    if bool(stored.isinf().any()):
        worst = float(scales.max())
        raise CodecError(f"a scale of {worst:.4g} (amax {worst * QMAX:.4g}) overflows {dtype}; "
                         f"{codec} cannot encode it (int8-fp32 can)")
    return stored
