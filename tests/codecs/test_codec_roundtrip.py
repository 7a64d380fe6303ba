"""Encode/decode round trips: odd geometries, the error bounds, zeros, denormals, saturation,
NaN/Inf refused, and encoded sizes taken from what encode really writes."""

from __future__ import annotations

import pytest
import torch

from kvstore import kernels
from kvstore.codecs import CODECS, get_codec
from kvstore.codecs.fp8 import E4M3_MAX
from kvstore.errors import CodecError, LayoutMismatchError
from kvstore.layout import KVLayout

from codec_testing import int8_bound, random_kv

# (layers, kv_heads, head_dim, block_size): odd everything, one element, a real-sized head.
GEOMETRIES = [(3, 3, 5, 7), (1, 1, 1, 1), (2, 1, 3, 16), (2, 4, 128, 16)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
LOSSY = [name for name in CODECS if get_codec(name).lossy]
EIGHT_BIT = [name for name in CODECS if not name.startswith("int4")]  # int4's bounds: test_codec_int4.py


def _layout(geometry: tuple[int, int, int, int], dtype: torch.dtype) -> KVLayout:
    layers, heads, head_dim, block_size = geometry
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, block_size=block_size, dtype=dtype)


def _round_trip(name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codec = get_codec(name)
    encoded = codec.encode(x)
    out = torch.full_like(x, float("nan"))
    assert codec.decode(encoded, out) is out
    return encoded, out


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", EIGHT_BIT)
def test_round_trip_within_the_codecs_bound(name: str, geometry: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    layout = _layout(geometry, dtype)
    x = random_kv(layout, 5, seed=sum(geometry))
    encoded, out = _round_trip(name, x)
    assert encoded.shape == (5, get_codec(name).encoded_bytes(layout))
    if name == "none":
        assert torch.equal(out.view(torch.uint8), x.view(torch.uint8))
        return
    err = (out.float() - x.float()).abs()
    if name.startswith("int8"):
        bad = err > int8_bound(x, dtype)
    else:  # fp8: 2**-4 of the element, or 2**-10 of the block's scale in e4m3's subnormal range
        scale = x.float().abs().amax(dim=(3, 5), keepdim=True) / E4M3_MAX
        eps = torch.finfo(dtype).eps
        bad = err > torch.maximum(x.float().abs() * 2**-4, scale * 2**-10) * (1 + 1e-5) + x.float().abs() * eps
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} elements past the bound, worst error {float(err.max()):.4g}"


@pytest.mark.parametrize("name", ["int8", "int8-fp32"])
def test_int8_error_is_amax_over_254_per_head_row(name: str) -> None:
    # float32 blocks decoded to float32: only the quantization error remains, nothing else.
    layout = _layout((4, 2, 64, 16), torch.float32)
    x = random_kv(layout, 6, seed=3, outliers=50.0)
    _, out = _round_trip(name, x)
    amax = x.abs().amax(dim=-1, keepdim=True)
    ratio = ((out - x).abs() / amax).max().item()
    slack = 2**-10 if name == "int8" else 2**-22  # the float16 scale is rounded up
    assert ratio <= (1 / 254) * (1 + slack), ratio
    assert ratio > 0.9 / 254, f"error {ratio:.5f} of amax: suspiciously exact, is it quantizing?"


def test_int8_stores_symmetric_codes_and_exact_row_maxima() -> None:
    layout = _layout((1, 1, 8, 2), torch.float32)
    x = random_kv(layout, 3, seed=4)
    x[0, 0, 1, 1, 0, 3] = -40.0  # a negative row maximum
    codec = get_codec("int8-fp32")
    encoded = codec.encode(x)
    _, elements = codec._views(encoded, layout)
    assert int(elements.min()) == -127 and int(elements.max()) == 127, "codes must saturate at +-127, never -128"
    assert bool((elements.abs().amax(dim=-1) == 127).all()), "each row's amax maps to +-127"
    out = codec.decode(encoded, torch.empty_like(x))
    assert float(out[0, 0, 1, 1, 0, 3]) == pytest.approx(-40.0, rel=1e-6)


@pytest.mark.parametrize("name", LOSSY)
def test_zero_rows_and_blocks_decode_to_zeros(name: str) -> None:
    layout = _layout((2, 2, 8, 4), torch.float16)
    x = random_kv(layout, 3, seed=5)
    x[0] = 0
    x[1, 1, 0, :, 1] = 0  # a whole head of K in one layer: int8 and fp8 scales of 0
    x[2, 0, 1, 2] = -0.0
    _, out = _round_trip(name, x)
    assert bool((out[0] == 0).all()) and bool((out[1, 1, 0, :, 1] == 0).all()) and bool((out[2, 0, 1, 2] == 0).all())
    assert not bool(out.isnan().any())


@pytest.mark.parametrize("name", [name for name in LOSSY if name in EIGHT_BIT])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_denormal_blocks_stay_finite_and_within_bound(name: str, dtype: torch.dtype) -> None:
    layout = _layout((1, 2, 16, 4), dtype)
    tiny = torch.finfo(dtype).smallest_normal
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn((2, *layout.block_shape), generator=gen) * tiny / 4).to(dtype)  # subnormals
    assert bool((x.abs() < tiny).all()) and bool((x != 0).any())
    _, out = _round_trip(name, x)
    assert bool(torch.isfinite(out).all())
    err = (out.float() - x.float()).abs()
    limit = int8_bound(x, dtype) if name.startswith("int8") else x.float().abs() * 2**-3 + 2 * tiny
    assert bool((err <= limit).all()), float(err.max())


def test_fp8_saturates_at_448_and_covers_the_float32_range() -> None:
    layout = _layout((1, 1, 4, 2), torch.float32)
    k = [3e38, -3e38, 1.0, -2e38, 5e37, 0.0, -1e30, 448.0]  # one scale group: K of the one head
    x = torch.tensor(k + [0.5] * 8).view(1, *layout.block_shape)
    codec = get_codec("fp8")
    encoded = codec.encode(x)
    _, elements = codec._views(encoded, layout)
    assert float(elements.float().abs().max()) == E4M3_MAX
    out = codec.decode(encoded, torch.empty_like(x))
    assert bool(torch.isfinite(out).all())
    assert float(out[0, 0, 0, 0, 0, 0]) == pytest.approx(3e38, rel=1e-6)
    assert float(out[0, 0, 0, 0, 0, 1]) == pytest.approx(-3e38, rel=1e-6)


def test_int8_scale_overflow_in_float16_is_a_clear_error() -> None:
    layout = _layout((1, 1, 4, 2), torch.float32)
    x = torch.ones((1, *layout.block_shape))
    x[0, 0, 1, 1, 0, 2] = 1e9  # scale 7.9e6 > float16's 65504
    with pytest.raises(CodecError, match=r"overflows torch.float16.*int8-fp32 can"):
        get_codec("int8").encode(x)
    _, out = _round_trip("int8-fp32", x)
    assert float(out[0, 0, 1, 1, 0, 2]) == pytest.approx(1e9, rel=1e-6)


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused_at_encode(name: str, poison: float) -> None:
    layout = _layout((2, 2, 8, 4), torch.bfloat16)
    x = random_kv(layout, 4, seed=7)
    x[2, 1, 1, 3, 0, 5] = poison
    kind = "1 NaN and 0 Inf" if poison != poison else "0 NaN and 1 Inf"
    with pytest.raises(CodecError, match=rf"block 2 holds {kind} values \(first at layer 1, V, token 3, head 0, dim 5\)"):
        get_codec(name).encode(x)


def test_raw_keeps_nan_bytes_as_put() -> None:
    layout = _layout((1, 1, 4, 2), torch.float16)
    x = random_kv(layout, 2, seed=8)
    x[1, 0, 0, 0, 0, 0] = float("nan")
    _, out = _round_trip("none", x)
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("name", CODECS)
def test_encode_into_strided_slots_writes_only_its_bytes(name: str) -> None:
    # Host slots are 4 KiB-aligned rows longer than the encoded block: encode writes rows in place.
    layout = _layout((2, 2, 16, 8), torch.float16)
    x = random_kv(layout, 3, seed=9)
    codec = get_codec(name)
    size = codec.encoded_bytes(layout)
    pool = torch.full((4, 8192), 0xEE, dtype=torch.uint8)
    rows = pool[1:4, :size]
    assert codec.encode(x, out=rows) is rows
    assert torch.equal(rows, codec.encode(x)), "in-place encode differs from a fresh one"
    assert bool((pool[1:4, size:] == 0xEE).all()) and bool((pool[0] == 0xEE).all())
    out = codec.decode(rows, torch.empty_like(x))
    assert torch.equal(out, codec.decode(codec.encode(x), torch.empty_like(x)))


def test_encoded_sizes_measured_from_encode() -> None:
    # The ratio comes from the bytes encode writes, not from a formula: 24 layers, 2 KV heads,
    # head dim 64, block 16, float16 (the benchmark layout).
    layout = KVLayout(num_layers=24, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
    x = random_kv(layout, 2, seed=10)
    ratios = {name: x[0].numel() * x.element_size() / get_codec(name).encode(x).shape[1] for name in CODECS}
    assert ratios["none"] == 1.0
    assert 1.93 < ratios["int8"] < 1.95, ratios
    assert 1.87 < ratios["int8-fp32"] < 1.89, ratios
    assert 1.98 < ratios["fp8"] <= 2.0, ratios


def test_bad_inputs_are_clear_errors() -> None:
    layout = _layout((1, 1, 4, 2), torch.float16)
    x = random_kv(layout, 2, seed=11)
    codec = get_codec("int8")
    with pytest.raises(LayoutMismatchError, match=r"\[n, num_layers, 2, block_size"):
        codec.encode(x[0])
    with pytest.raises(LayoutMismatchError, match="int8"):
        codec.encode(x.to(torch.int8))
    with pytest.raises(LayoutMismatchError, match="out has 1 rows"):
        codec.encode(x, out=torch.empty((1, codec.encoded_bytes(layout)), dtype=torch.uint8))
    encoded = codec.encode(x)
    with pytest.raises(LayoutMismatchError, match="expected"):
        codec.decode(encoded[:, :-16], torch.empty_like(x))
    with pytest.raises(LayoutMismatchError, match="out of 2 contiguous blocks"):
        codec.decode(encoded, torch.empty_like(x)[:1])


def test_fp8_bit_moving_decode_matches_torch_for_every_code() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    expected = codes.float()
    got = kernels.reference.dequantize_fp8(codes.view(1, 1, 256), torch.ones((1, 1)), torch.empty((1, 1, 256)))[0, 0]
    agree = (got == expected) | expected.isnan()  # 0x7f and 0xff are NaN; encode never writes them
    assert bool(agree.all()), (~agree).nonzero().flatten().tolist()
