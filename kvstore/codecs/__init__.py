"""Codecs: how a tier represents a block (docs/storage-format.md, "Codecs").

``get_codec(name)`` gives the codec a config names; ``codec_for_header`` the one that wrote an
encoded block, so a reader follows the block's own header rather than today's configuration.

| name        | lossy | elements          | scales                                  |
|-------------|-------|-------------------|-----------------------------------------|
| ``none``    | no    | the block's bytes | none (no header either)                 |
| ``int8``    | yes   | int8              | float16 per (layer, K/V, token, head)   |
| ``int8-fp32`` | yes | int8              | float32 per (layer, K/V, token, head)   |
| ``fp8``     | yes   | float8 e4m3fn     | float32 per (layer, K/V, block, head)   |
| ``int4-rot`` | yes  | 4-bit, two per byte | float16 per 64 values of a head row turned by a fixed rotation |
| ``int4-norot`` | yes | 4-bit, two per byte | float16 per 64 values of a head row (the ablation: no rotation) |
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.codecs.base import Codec
from kvstore.codecs.fp8 import Fp8Codec
from kvstore.codecs.framed import FramedCodec
from kvstore.codecs.header import BlockHeader
from kvstore.codecs.int4 import Int4Codec, Int4RotCodec
from kvstore.codecs.int8 import Int8Codec, Int8Fp32Codec
from kvstore.codecs.raw import RawCodec
from kvstore.codecs.scaled import ScaledCodec
from kvstore.errors import CodecFormatError, ConfigError
from kvstore.layout import KVLayout

_FACTORIES: dict[str, Callable[[], Codec]] = {
    RawCodec.name: RawCodec,
    Int8Codec.name: Int8Codec,
    Int8Fp32Codec.name: Int8Fp32Codec,
    Fp8Codec.name: Fp8Codec,
    Int4RotCodec.name: Int4RotCodec,
    Int4Codec.name: Int4Codec,
}
CODECS: tuple[str, ...] = tuple(_FACTORIES)
AUTO = "auto"  # not a codec: a disk tier's measured choice of int8 or none (kvstore/store/levels/codec_choice.py)
_INSTANCES: dict[str, Codec] = {name: make() for name, make in _FACTORIES.items()}


def get_codec(name: str) -> Codec:
    """The codec registered as ``name`` (shared, stateless instance).

    Raises:
        ConfigError: an unknown name (the message lists the known ones).
    """
    codec = _INSTANCES.get(name) if isinstance(name, str) else None
    if codec is None:
        raise ConfigError(f"codec must be one of {list(CODECS)}, got {name!r}")
    return codec


def sizing_codec(setting: str) -> Codec:
    """The codec a ``*_codec`` setting's blocks are sized by before a store opens: ``auto``
    (chosen then, int8 or none) as raw blocks, the larger; any other as ``get_codec``."""
    return get_codec("none" if setting == AUTO else setting)


def stored_bytes(codec: Codec, layout: KVLayout, align: int) -> int:
    """Bytes a medium stores per block of ``layout`` under ``codec``: the encoded size rounded
    up to ``align``; raw blocks are stored as they are (not padded)."""
    if not codec.lossy:
        return layout.bytes_per_block
    return -(-codec.encoded_bytes(layout) // align) * align


def codec_for_header(header: BlockHeader) -> FramedCodec:
    """The codec whose blocks carry ``header``'s codec id, version and scale dtype.

    Raises:
        CodecFormatError: no codec of this reader writes such blocks (e.g. a newer version).
    """
    for codec in _INSTANCES.values():
        if (isinstance(codec, FramedCodec) and codec.codec_id == header.codec_id
                and codec.version == header.version and codec.scale_dtype == header.scale_dtype
                and codec.scale_layout == header.scale_layout):
            return codec
    raise CodecFormatError(
        f"no codec here reads codec id {header.codec_id} version {header.version} with "
        f"{header.scale_dtype} scales (layout {header.scale_layout})"
    )


__all__ = ["AUTO", "CODECS", "Codec", "Fp8Codec", "FramedCodec", "Int4Codec", "Int4RotCodec", "Int8Codec", "Int8Fp32Codec", "RawCodec",
           "ScaledCodec", "codec_for_header", "get_codec", "sizing_codec", "stored_bytes"]
