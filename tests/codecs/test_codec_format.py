"""The encoded formats byte for byte: golden test vectors (also in docs/storage-format.md),
and a reader that refuses every header it does not know."""

from __future__ import annotations

import pytest
import torch

from kvstore.codecs import codec_for_header, get_codec
from kvstore.codecs.header import HEADER_BYTES, BlockHeader
from kvstore.errors import CodecFormatError, ConfigError
from kvstore.layout import KVLayout

# The docs' test vector: 1 layer, block size 2, 1 KV head, head dim 4, float16; K then V.
VECTOR_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.float16)
VECTOR = torch.tensor(
    [1.0, -0.5, 0.25, 2.0, 0.0, 0.0, 0.0, 0.0,  # K: token 0, token 1 (a zero row)
     -3.0, 1.5, 0.1, 0.0, 100.0, -100.0, 50.0, 0.001],  # V: token 0, token 1
    dtype=torch.float16,
).view(1, *VECTOR_LAYOUT.block_shape)
GOLDEN = {  # codec -> (encoded bytes, decoded values); format version 1 of each (docs/storage-format.md)
    "int8": (
        "4b56434201010101010000000100000002000000010000000400000018000000"
        "092400000d264d3a3fe0107f00000000813f04007f813f000000000000000000",
        [0.9931640625, -0.50439453125, 0.252197265625, 2.001953125, 0, 0, 0, 0,
         -3.001953125, 1.4892578125, 0.09454345703125, 0, 100.0, -100.0, 49.625, 0],
    ),
    "int8-fp32": (
        "4b56434201010103010000000100000002000000010000000400000020000000"
        "0402813c000000000683c13c2693493f40e0107f00000000814004007f814000",
        [1.0078125, -0.50390625, 0.251953125, 2.0, 0, 0, 0, 0,
         -3.0, 1.51171875, 0.094482421875, 0, 100.0, -100.0, 50.40625, 0],
    ),
    "fp8": (
        "4b56434202010103020000000100000002000000010000000400000018000000"
        "2549923b4992643e76ee667e00000000d54d2e007efe76020000000000000000",
        [1.0, -0.5, 0.25, 2.0, 0, 0, 0, 0,
         -2.90234375, 1.451171875, 0.09765625, 0, 100.0, -100.0, 50.0, 0.0008721351623535156],
    ),
    "int4-rot": (
        "4b56434203010101030000000100000002000000010000000400000010000000"
        "ef320000e9342b4c7ef388880505f9c6",
        [0.97509765625, -0.54150390625, 0.324951171875, 2.05859375, 0, 0, 0, 0,
         -3.068359375, 1.5341796875, 0, 0, 100.0, -100.0, 50.0, 0],
    ),
    "int4-norot": (
        "4b56434204010101030000000100000002000000010000000400000010000000"
        "453400006736ab4a6bf88888b0880f8b",
        [0.93408203125, -0.400390625, 0.1334228515625, 2.001953125, 0, 0, 0, 0,
         -3.001953125, 1.400390625, 0.2000732421875, 0.2000732421875, 100.0, -100.0, 46.6875, 6.66796875],
    ),
}


def _row(hex_bytes: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(bytes.fromhex(hex_bytes)), dtype=torch.uint8).view(1, -1)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes(name: str) -> None:
    encoded_hex, decoded = GOLDEN[name]
    codec = get_codec(name)
    assert codec.encoded_bytes(VECTOR_LAYOUT) == len(encoded_hex) // 2 == (48 if name.startswith("int4") else 64)
    assert bytes(codec.encode(VECTOR)[0].numpy()).hex() == encoded_hex
    out = codec.decode(_row(encoded_hex), torch.empty_like(VECTOR))
    assert out.flatten().tolist() == decoded


def test_raw_is_the_blocks_own_bytes() -> None:
    encoded = get_codec("none").encode(VECTOR)
    assert bytes(encoded[0].numpy()) == VECTOR.numpy().tobytes()


def _tampered(name: str, offset: int, value: int) -> torch.Tensor:
    row = _row(GOLDEN[name][0]).clone()
    row[0, offset] = value
    return row


@pytest.mark.parametrize(
    ("offset", "value", "why"),
    [
        (0, ord("X"), "magic"),
        (4, 9, "codec_id is 9"),
        (5, 2, "version is 2"),
        (6, 3, "dtype is torch.float32"),
        (6, 77, "unknown dtype code 77"),
        (7, 1, "scale_dtype is torch.float16"),
        (8, 1, "scale_layout is 1"),
        (10, 1, "reserved header bytes"),
        (12, 2, "block_shape"),
        (28, 0x19, "body_bytes is 25"),
    ],
)
def test_a_header_this_reader_does_not_know_is_refused(offset: int, value: int, why: str) -> None:
    codec = get_codec("fp8")
    good = _row(GOLDEN["fp8"][0])
    rows = torch.cat([good, _tampered("fp8", offset, value), good])
    assert codec.readable(rows, VECTOR_LAYOUT).tolist() == [True, False, True]
    out = torch.full((3, *VECTOR_LAYOUT.block_shape), 7.0, dtype=torch.float16)
    with pytest.raises(CodecFormatError, match=rf"encoded block 1 of 3 is refused by fp8: .*{why}"):
        codec.decode(rows, out)
    assert bool((out == 7.0).all()), "a refused decode must not write"


def test_blocks_of_another_codec_or_geometry_are_refused() -> None:
    int8 = _row(GOLDEN["int8"][0])
    assert get_codec("int8-fp32").readable(int8, VECTOR_LAYOUT).tolist() == [False]
    assert get_codec("fp8").readable(int8, VECTOR_LAYOUT).tolist() == [False]
    # Same encoded size, other geometry: 2 layers of block size 1 instead of 1 of 2.
    other = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=1, dtype=torch.float16)
    assert get_codec("int8").encoded_bytes(other) == 64
    with pytest.raises(CodecFormatError, match="block_shape is"):
        get_codec("int8").decode(int8, torch.empty((1, *other.block_shape), dtype=torch.float16))
    with pytest.raises(CodecFormatError, match=r"dtype is torch\.float16"):
        get_codec("int8").decode(int8, torch.empty(VECTOR.shape, dtype=torch.bfloat16))


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_the_header_names_the_codec_that_reads_it(name: str) -> None:
    header = BlockHeader.unpack(bytes.fromhex(GOLDEN[name][0])[:HEADER_BYTES])
    assert header.block_shape == VECTOR_LAYOUT.block_shape and header.dtype == torch.float16
    assert codec_for_header(header) is get_codec(name)


def test_no_codec_reads_an_unknown_version() -> None:
    raw = bytes(_tampered("int8", 5, 2)[0, :HEADER_BYTES].numpy())
    with pytest.raises(CodecFormatError, match="codec id 1 version 2"):
        codec_for_header(BlockHeader.unpack(raw))
    with pytest.raises(CodecFormatError, match="32-byte header"):
        BlockHeader.unpack(raw[:31])


def test_unknown_codec_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"codec must be one of \['none', 'int8', 'int8-fp32', 'fp8', 'int4-rot', "
                                          r"'int4-norot'\], got 'zstd'"):
        get_codec("zstd")
