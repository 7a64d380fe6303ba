"""Each codec's reader of encoded blocks (raw, int8, int8-fp32, fp8, int4-rot, int4-norot), as
a tier reads them back from host slots, disk slabs and the remote tier.

Input: one byte picks the codec, the rest is one encoded row (cut or zero-padded to the
codec's size for the harness's layout). What must hold:

- ``readable`` and ``decode`` agree: a row ``decode`` accepts is one ``readable`` called
  readable, and ``decode`` refuses every other with CodecFormatError (a tier turns exactly
  those into misses);
- an accepted header re-packs to the row's own 32 bytes;
- raw rows decode to their own bytes; a lossy row whose values are finite re-encodes, and
  decodes again to within the codec's quantization step of its first decoding (for a rotated
  codec, each head row within its share of the row's norm).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstore.codecs import CODECS, FramedCodec, get_codec
from kvstore.codecs.header import HEADER_BYTES, BlockHeader
from kvstore.errors import CodecError, CodecFormatError
from kvstore.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=4, dtype=torch.float16)
# |second decode - first decode| <= STEP * the block's largest |value|: a quantization step
# of each codec's coarsest scale group, with room for float16 rounding of the scales
STEP = {"int8": 1 / 64, "int8-fp32": 1 / 64, "fp8": 1 / 8, "int4-norot": 1 / 2}
# A rotated codec quantizes the turned head row: each turned value is off by at most half a
# step (its group's amax / 14, the amax at most the row's norm), and the turn back keeps the
# norm, so a head row's error is at most sqrt(head_dim) / 14 of its norm (0.57 here)
ROTATED_STEP = {"int4-rot": 0.6}


def _row(codec_name: str, data: bytes) -> torch.Tensor:
    size = get_codec(codec_name).encoded_bytes(LAYOUT)
    body = data[:size].ljust(size, b"\0")
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).view(1, size)


def make() -> Callable[[bytes], None]:
    for name in CODECS:
        get_codec(name).prepare()

    def check(data: bytes) -> None:
        if not data:
            return
        name = CODECS[data[0] % len(CODECS)]
        codec = get_codec(name)
        src = _row(name, data[1:])
        readable = bool(codec.readable(src, LAYOUT)[0])
        out = torch.empty((1, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
        try:
            codec.decode(src, out)
        except CodecFormatError:
            assert not readable, f"{name}: readable() accepted a row decode() refused"
            return
        assert readable, f"{name}: decode() accepted a row readable() refused"
        if not isinstance(codec, FramedCodec):
            assert bytes(out.view(torch.uint8).flatten().numpy()) == bytes(src.flatten().numpy())
            return
        raw = bytes(src[0, :HEADER_BYTES].numpy())
        assert BlockHeader.unpack(raw).pack() == raw, f"{name}: the header does not re-pack to its bytes"
        if not bool(torch.isfinite(out).all()):
            return  # garbage scales can overflow float16; the tiers' checksums keep such rows out
        try:
            again = codec.decode(codec.encode(out), torch.empty_like(out))
        except CodecError:
            return  # a value whose scale the scale dtype cannot hold: refused, as at put
        if name in ROTATED_STEP:
            norms = out.float().norm(dim=-1)
            errs = (again.float() - out.float()).norm(dim=-1)
            worst = float((errs - ROTATED_STEP[name] * norms).max())
            assert worst <= 1e-3, f"{name}: re-encoding moved a head row by {worst} past {ROTATED_STEP[name]} of its norm"
            return
        amax = float(out.float().abs().max())
        err = float((again.float() - out.float()).abs().max())
        assert err <= STEP[name] * amax + 1e-3, f"{name}: re-encoding moved a value by {err} (block amax {amax})"

    return check


def seeds() -> dict[str, bytes]:
    """A block of each codec encoded from real-looking KV (a few outlier channels), and one
    with all-zero values."""
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((1, *LAYOUT.block_shape), generator=gen) * 0.5
    kv[..., 3] *= 20  # keys and values have outlier channels
    blocks = {"randn": kv.to(LAYOUT.dtype), "zeros": torch.zeros((1, *LAYOUT.block_shape), dtype=LAYOUT.dtype)}
    out = {}
    for i, name in enumerate(CODECS):
        for kind, block in blocks.items():
            out[f"{name}-{kind}"] = bytes([i]) + bytes(get_codec(name).encode(block).flatten().numpy())
    return out
