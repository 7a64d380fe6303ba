"""Triton helpers for quantized pages (``kernels.PAGE_CODES``), shared by the attention and
``store_kv`` kernels: decoding a tile of codes, and encoding float rows into codes and scales
exactly as ``kernels.reference.quantize_rows`` does (round half to even, scales rounded up).
"""

from __future__ import annotations

import triton
import triton.language as tl

_RINT = 12582912.0  # 1.5 * 2**23: (x + _RINT) - _RINT rounds |x| < 2**22 to an integer, half to even


@triton.jit
def decode_codes(codes, FP8: tl.constexpr):
    """float32 values of a tile of codes: int8 as they are, e4m3fn bytes (loaded as uint8)
    through float16 bits (the value times 2**-8, exactly; the caller's scale carries the 256)."""
    if FP8:
        u = codes.to(tl.int32) & 0xFF
        half = (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
        return half.to(tl.float32) * 256.0
    return codes.to(tl.float32)


@triton.jit
def _rint(x):
    return (x + _RINT) - _RINT


@triton.jit
def row_scales(x, QMAX: tl.constexpr):
    """One float16 scale per row of the float32 tile ``x`` [rows, dims]: amax / QMAX, rounded up."""
    ideal = tl.max(tl.abs(x), axis=1) / QMAX
    scale = ideal.to(tl.float16)
    low = scale.to(tl.float32) < ideal
    bits = scale.to(tl.int16, bitcast=True) + low.to(tl.int16)
    scale = bits.to(tl.float16, bitcast=True)
    return tl.minimum(scale.to(tl.float32), 65504.0).to(tl.float16)


@triton.jit
def encode_codes(x, scale, FP8: tl.constexpr):
    """The codes of the float32 tile ``x`` [rows, dims] under its rows' float16 ``scale``: int8
    ``rint(x / s)`` clamped to 127, or e4m3fn bytes (as int8 bit patterns) of ``x / s`` rounded
    to nearest even (|x / s| <= 448 by the scale's construction)."""
    s = scale.to(tl.float32)
    s = tl.where(s > 0, s, 1.0)
    v = tl.div_rn(x, s[:, None])
    if FP8:
        a = tl.minimum(tl.abs(v), 448.0)
        sign = (v < 0).to(tl.int32) << 7
        exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(a)) for normal floats
        normal = a >= 0.015625  # 2**-6: e4m3fn's smallest normal
        e = tl.where(normal, exponent, -6)
        # a / 2**(e - 3) is exact (a power of two); its rounding is the only one
        m = _rint(a * ((3 - e + 127) << 23).to(tl.float32, bitcast=True))
        carry = m >= 16.0
        e = tl.where(carry, e + 1, e)
        m = tl.where(carry, 8.0, m)
        mi = m.to(tl.int32)
        code = tl.where(normal | (mi >= 8), ((e + 7) << 3) | (mi - 8), mi)
        return (code | sign).to(tl.int8)
    return tl.minimum(tl.maximum(_rint(v), -127.0), 127.0).to(tl.int8)
