"""int4-rot and int4-norot: the documented error bounds on odd layouts and every dtype, the
rotation (orthogonal, fixed bytes), sizes in bits per value, refusals (NaN/Inf, scale overflow,
foreign headers), and chunked encodes equal to block-by-block ones."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from kvstore.codecs import codec_for_header, get_codec
from kvstore.codecs.header import HEADER_BYTES, BlockHeader
from kvstore.codecs.int4 import GROUP, Int4Codec
from kvstore.codecs.rotation import rotation, rotation_name, splitmix64
from kvstore.errors import CodecError, CodecFormatError, LayoutMismatchError
from kvstore.layout import KVLayout

from codec_testing import random_kv

INT4 = ["int4-rot", "int4-norot"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (layers, kv_heads, head_dim, block_size): one layer / one head / one token, the head dims of
# real models (64, 128: one and two groups), a short one (16: one group of 16), non-powers of
# two (80: groups of 64 and 16, and a random orthogonal rotation; 5; 1).
GEOMETRIES = [(1, 1, 64, 1), (2, 3, 16, 4), (1, 2, 128, 16), (2, 1, 80, 3), (3, 3, 5, 7), (1, 1, 1, 1)]
SMOLLM2 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float16)


def _layout(geometry: tuple[int, int, int, int], dtype: torch.dtype) -> KVLayout:
    layers, heads, head_dim, block_size = geometry
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, block_size=block_size, dtype=dtype)


def _codec(name: str) -> Int4Codec:
    codec = get_codec(name)
    assert isinstance(codec, Int4Codec)
    return codec


def _stored_scales(name: str, encoded: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Float32 ``[n, layers, 2, block_size, kv_heads, groups]``: the scales the bytes hold."""
    scales, _ = _codec(name)._views(encoded, layout)
    return scales.float()


def _bound(name: str, x: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The documented per-element bound (docs/storage-format.md): without the rotation ``s / 2``
    of the element's group; with it the row's error norm ``sqrt(sum_g n_g (s_g / 2)**2)``; plus
    float32 rounding of the two rotations and the output dtype's rounding."""
    head_dim = x.shape[-1]
    sizes = torch.tensor([min(GROUP, head_dim - g * GROUP) for g in range(scales.shape[-1])], dtype=torch.float32)
    xf = x.float()
    slack = xf.abs() * 2**-22  # float32 rounding of y / s next to a code boundary
    if name == "int4-norot":
        bound = torch.repeat_interleave(scales / 2, sizes.long(), dim=-1)[..., :head_dim]
    else:
        norm = ((scales / 2) ** 2 * sizes).sum(dim=-1, keepdim=True).sqrt()
        bound = norm + 4 * head_dim * 2**-24 * xf.norm(dim=-1, keepdim=True)
    bound = bound + slack
    if dtype != torch.float32:
        finfo = torch.finfo(dtype)
        bound = bound + (xf.abs() + bound) * finfo.eps / 2 + finfo.smallest_normal * finfo.eps
    return bound


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", INT4)
def test_round_trip_within_the_documented_bound(name: str, geometry: tuple[int, int, int, int],
                                                dtype: torch.dtype) -> None:
    layout = _layout(geometry, dtype)
    x = random_kv(layout, 3, seed=sum(geometry))
    codec = get_codec(name)
    encoded = codec.encode(x)
    assert encoded.shape == (3, codec.encoded_bytes(layout))
    out = torch.full_like(x, float("nan"))
    assert codec.decode(encoded, out) is out
    err = (out.float() - x.float()).abs()
    bound = _bound(name, x, _stored_scales(name, encoded, layout), dtype)
    bad = err > bound
    assert not bool(bad.any()), (f"{name}: {int(bad.sum())} elements past the bound, worst error "
                                 f"{float(err.max()):.4g}, first at {bad.nonzero()[0].tolist()}")
    if layout.head_dim > 1:  # it quantized: the error is of the bound's order, not far below it
        assert float((err / bound).max()) > 0.2


@pytest.mark.parametrize("name", INT4)
def test_error_per_group_is_at_most_its_max_over_15(name: str) -> None:
    # The bound without the stored scales: s <= max|y| / 7.5 rounded up to float16, y the
    # (rotated) group; for int4-rot a rotated value is at most its row's L2 norm.
    layout = _layout((4, 2, 64, 16), torch.float32)
    x = random_kv(layout, 4, seed=3, outliers=50.0)
    codec = get_codec(name)
    out = codec.decode(codec.encode(x), torch.empty_like(x))
    err = (out - x).abs()
    if name == "int4-norot":
        amax = x.view(*x.shape[:-1], -1, GROUP).abs().amax(dim=-1)
        ratio = (err.view(*x.shape[:-1], -1, GROUP) / amax.unsqueeze(-1)).max()
        assert float(ratio) <= 1 / 15 * (1 + 2**-10), float(ratio)
        assert float(ratio) > 0.9 / 15
    else:
        ratio = (err / x.norm(dim=-1, keepdim=True)).max()
        assert float(ratio) <= math.sqrt(64) / 15 * (1 + 2**-10), float(ratio)


def test_the_rotation_halves_the_error_on_outlier_channels() -> None:
    # Keys with outlier channels (the pattern real keys show): one group's scale is set by the
    # outlier, and every other value in that group is coarse. The rotation spreads it.
    layout = _layout((4, 2, 64, 16), torch.float32)
    x = random_kv(layout, 4, seed=12, outliers=20.0)
    rel = {}
    for name in INT4:
        codec = get_codec(name)
        out = codec.decode(codec.encode(x), torch.empty_like(x))
        rel[name] = float((out - x)[:, :, 0].norm() / x[:, :, 0].norm())
    assert rel["int4-rot"] < 0.6 * rel["int4-norot"], rel
    assert 0.05 < rel["int4-rot"] < 0.12, rel  # about 0.09, the error of 4-bit codes of Gaussian values


def test_zeros_decode_to_zeros_and_subnormal_groups_to_at_most_2_pow_minus_25() -> None:
    layout = _layout((1, 2, 64, 2), torch.float32)
    x = torch.zeros((2, *layout.block_shape))
    x[1] = 1e-39  # float32 subnormals: the float16 scale rounds up to its smallest, 2**-24
    for name in INT4:
        codec = get_codec(name)
        out = codec.decode(codec.encode(x), torch.empty_like(x))
        assert bool((out[0] == 0).all()), name
        assert float((out[1] - x[1]).abs().max()) <= 2**-25 * (1 + 1e-6) * (8 if name == "int4-rot" else 1)


@pytest.mark.parametrize("name", INT4)
def test_a_chunked_encode_equals_block_by_block(name: str) -> None:
    # 131,072 elements per block: a chunk holds 8 blocks, so 11 blocks take two chunks.
    layout = _layout((8, 4, 128, 16), torch.bfloat16)
    x = random_kv(layout, 11, seed=13)
    codec = get_codec(name)
    encoded = codec.encode(x)
    for i in (0, 7, 8, 10):
        assert torch.equal(encoded[i], codec.encode(x[i : i + 1])[0]), i
    out = codec.decode(encoded, torch.empty_like(x))
    for i in (0, 8, 10):
        assert torch.equal(out[i], codec.decode(encoded[i : i + 1], torch.empty_like(x[:1]))[0]), i


# ------------------------------------------------------------------------------ rotation


@pytest.mark.parametrize("head_dim", [1, 2, 4, 5, 16, 64, 80, 96, 128, 256])
def test_the_rotation_is_orthogonal(head_dim: int) -> None:
    m = rotation(head_dim).double()
    eye = torch.eye(head_dim, dtype=torch.float64)
    assert float((m @ m.T - eye).abs().max()) < 1e-6
    assert float((m.T @ m - eye).abs().max()) < 1e-6
    if rotation_name(head_dim) == "hadamard":
        assert bool((m.abs() == rotation(head_dim).abs()[0, 0].double()).all()), "entries +-1/sqrt(head_dim)"
        assert torch.equal(rotation(head_dim), rotation(head_dim).T)


def test_the_rotation_is_fixed_bytes() -> None:
    # Blocks outlive processes: these are the matrices every reader must use.
    digests = {d: hashlib.sha256(rotation(d).numpy().tobytes()).hexdigest()[:16] for d in (1, 4, 64, 128)}
    assert digests == {1: "e00e5eb9444182f3", 4: "a50992f9be1cd34f", 64: "6a8bf9b9bc291de7",
                       128: "6b407544270e0bc0"}
    assert rotation(4).tolist() == [[0.5, 0.5, 0.5, 0.5], [0.5, -0.5, 0.5, -0.5],
                                    [0.5, 0.5, -0.5, -0.5], [0.5, -0.5, -0.5, 0.5]]
    # Other head dims: the seeded random orthogonal matrix (splitmix64 -> Box-Muller -> QR).
    assert [rotation_name(d) for d in (5, 80, 96)] == ["random-orthogonal"] * 3
    # (to 1e-6: another LAPACK may round the float64 QR differently in its last bits)
    assert rotation(5)[0].tolist() == pytest.approx([-0.606892, 0.6860276, -0.0549183, 0.2589982, -0.3015826],
                                                    abs=1e-6)
    assert rotation(5)[:, 4].tolist() == pytest.approx([-0.3015826, -0.4487728, -0.683708, -0.1295106, -0.4726746],
                                                       abs=1e-6)


def test_splitmix64_matches_its_reference_outputs() -> None:
    # The first outputs of splitmix64 from seed 0 (the reference implementation's).
    assert splitmix64(0, 3) == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


# ------------------------------------------------------------------------------ sizes


@pytest.mark.parametrize("name", INT4)
def test_4_25_bits_per_value_scales_included_and_the_header_adds_little(name: str) -> None:
    codec = get_codec(name)
    bench = KVLayout(num_layers=24, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
    for layout in (SMOLLM2, bench, _layout((32, 8, 128, 16), torch.bfloat16)):
        size = codec.encode(random_kv(layout, 1, seed=14)).shape[1]
        assert size == codec.encoded_bytes(layout)
        bits = 8 * size / layout.elements_per_block
        assert 4.25 < bits <= 4.25 + 8 * (HEADER_BYTES + 15) / layout.elements_per_block, (layout, bits)
        body = BlockHeader.unpack(bytes(codec.encode(random_kv(layout, 1))[0, :HEADER_BYTES].numpy())).body_bytes
        assert 8 * body / layout.elements_per_block == 4.25
    assert codec.encoded_bytes(SMOLLM2) == 32 + 30 * 2 * 16 * 3 * (2 + 32) == 97952
    assert SMOLLM2.bytes_per_block / codec.encoded_bytes(SMOLLM2) > 3.76  # vs float16 blocks
    # A head_dim below the group: one scale per row, 4.5 bits at head_dim 32, 5 at 16.
    for head_dim, bits in ((32, 4.5), (16, 5.0)):
        short = _layout((2, 2, head_dim, 16), torch.float16)
        assert 8 * (codec.encoded_bytes(short) - HEADER_BYTES) / short.elements_per_block == bits


def test_two_codes_per_byte_low_nibble_first() -> None:
    layout = _layout((1, 1, 4, 1), torch.float32)
    # One group per row: K = (7.5, -7.5, 0.5, 3.5) has s = 1, codes 15, 0, 8, 11; V all zero.
    x = torch.tensor([7.5, -7.5, 0.5, 3.5, 0, 0, 0, 0]).view(1, *layout.block_shape)
    encoded = get_codec("int4-norot").encode(x)
    scales = encoded[0, HEADER_BYTES : HEADER_BYTES + 4].view(torch.float16).tolist()
    assert scales == [1.0, 0.0]
    assert encoded[0, HEADER_BYTES + 4 : HEADER_BYTES + 8].tolist() == [0x0F, 0xB8, 0x88, 0x88]
    assert get_codec("int4-norot").decode(encoded, torch.empty_like(x)).flatten().tolist() == x.flatten().tolist()


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("name", INT4)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused_naming_the_block(name: str, poison: float) -> None:
    layout = _layout((2, 2, 64, 4), torch.bfloat16)
    x = random_kv(layout, 4, seed=7)
    x[2, 1, 1, 3, 0, 5] = poison
    kind = "1 NaN and 0 Inf" if poison != poison else "0 NaN and 1 Inf"
    message = rf"block 2 holds {kind} values \(first at layer 1, V, token 3, head 0, dim 5\); {name} cannot"
    with pytest.raises(CodecError, match=message):
        get_codec(name).encode(x)
    with pytest.raises(CodecError, match=message):
        get_codec(name).check_encodable(x)
    get_codec(name).check_encodable(x[:2])


def test_a_scale_past_float16_is_refused_at_put_and_at_encode() -> None:
    layout = _layout((1, 1, 64, 2), torch.float32)
    x = torch.ones((3, *layout.block_shape))
    x[1, 0, 0, 1, 0] = 1e5  # a constant row: rotated, 8 * 1e5 in one value, past 7.5 * 65504
    x[2, 0, 1, 0, 0, 9] = 1e5  # one large value: rotated, 1e5 / 8 in each of 64 values
    rot, norot = get_codec("int4-rot"), get_codec("int4-norot")
    for call in (rot.encode, rot.check_encodable):
        with pytest.raises(CodecError, match=r"block 1 has a group of int4-rot values up to 8e\+05"):
            call(x)
    rot.check_encodable(x[2:])  # past the quick test's limit, and encodable
    out = rot.decode(rot.encode(x[2:]), torch.empty_like(x[2:]))
    assert float(out[0, 0, 1, 0, 0, 9]) == pytest.approx(1e5, rel=0.02)
    norot.check_encodable(x)  # 1e5 < 7.5 * 65504 without the rotation
    x[0, 0, 0, 0, 0, 0] = 5e5
    with pytest.raises(CodecError, match=r"block 0 has a group of int4-norot values up to 5e\+05"):
        norot.check_encodable(x)


def _tampered(encoded: torch.Tensor, offset: int, value: int) -> torch.Tensor:
    row = encoded.clone()
    row[1, offset] = value
    return row


@pytest.mark.parametrize("name", INT4)
@pytest.mark.parametrize(("offset", "value", "why"), [(4, 9, "codec_id is 9"), (5, 2, "version is 2"),
                                                       (8, 1, "scale_layout is 1"), (7, 3, "scale_dtype is")])
def test_a_header_this_reader_does_not_know_is_refused(name: str, offset: int, value: int, why: str) -> None:
    layout = _layout((2, 1, 64, 2), torch.float16)
    codec = get_codec(name)
    x = random_kv(layout, 3, seed=15)
    rows = _tampered(codec.encode(x), offset, value)
    assert codec.readable(rows, layout).tolist() == [True, False, True]
    out = torch.full_like(x, 7.0)
    with pytest.raises(CodecFormatError, match=rf"encoded block 1 of 3 is refused by {name}: .*{why}"):
        codec.decode(rows, out)
    assert bool((out == 7.0).all()), "a refused decode must not write"
    with pytest.raises(CodecFormatError, match=rf"codec id {int(rows[1, 4])} version {int(rows[1, 5])}"):
        codec_for_header(BlockHeader.unpack(bytes(rows[1, :HEADER_BYTES].numpy())))


def test_each_codec_refuses_the_others_blocks_of_the_same_size() -> None:
    layout = _layout((2, 1, 64, 2), torch.float16)
    x = random_kv(layout, 1, seed=16)
    rot, norot = _codec("int4-rot"), _codec("int4-norot")
    assert rot.encoded_bytes(layout) == norot.encoded_bytes(layout)
    for writer, reader in ((rot, norot), (norot, rot)):
        encoded = writer.encode(x)
        assert reader.readable(encoded, layout).tolist() == [False]
        with pytest.raises(CodecFormatError, match=rf"codec_id is {writer.codec_id}"):
            reader.decode(encoded, torch.empty_like(x))
        assert codec_for_header(BlockHeader.unpack(bytes(encoded[0, :HEADER_BYTES].numpy()))) is writer


def test_bad_inputs_are_clear_errors() -> None:
    layout = _layout((1, 1, 64, 2), torch.float16)
    x = random_kv(layout, 2, seed=11)
    codec = get_codec("int4-rot")
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
    with pytest.raises(LayoutMismatchError, match="int4-rot encodes"):
        codec.encoded_bytes(KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=2, dtype=torch.uint8))
