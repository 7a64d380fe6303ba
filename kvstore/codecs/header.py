"""The 32-byte header that opens every encoded block (docs/storage-format.md, "Codecs").

Little-endian, packed (``struct`` format ``<4sBBBBB3xIIIII``)::

    off  size  field
      0     4  magic b"KVCB"
      4     1  codec id (1 int8, 2 fp8, 3 int4-rot, 4 int4-norot)
      5     1  format version of that codec (1)
      6     1  dtype of the decoded block (DTYPE_CODES)
      7     1  dtype of the scales (DTYPE_CODES)
      8     1  scale layout (SCALE_PER_TOKEN_HEAD, SCALE_PER_BLOCK_HEAD, SCALE_PER_HEAD_GROUP)
      9     3  reserved, zero
     12     4  num_layers
     16     4  block_size
     20     4  num_kv_heads
     24     4  head_dim
     28     4  body bytes (scales + elements; the header and the zero padding excluded)

A reader computes the exact header it expects and compares all 32 bytes, so any field it does
not know (another version, a reserved byte set) makes the block refused, never misread.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from kvstore.errors import CodecFormatError

MAGIC = b"KVCB"
HEADER_BYTES = 32
ALIGN = 16  # encoded blocks are padded to this, so fp32 scale views stay aligned row after row
_STRUCT = struct.Struct("<4sBBBBB3xIIIII")
assert _STRUCT.size == HEADER_BYTES

DTYPE_CODES: dict[torch.dtype, int] = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
DTYPES_BY_CODE: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}
SCALE_PER_TOKEN_HEAD = 1  # one scale per (layer, K/V, token, head)
SCALE_PER_BLOCK_HEAD = 2  # one scale per (layer, K/V, block, head)
SCALE_PER_HEAD_GROUP = 3  # one scale per (layer, K/V, token, head, group of head_dim values)

BlockShape = tuple[int, int, int, int, int]  # (num_layers, 2, block_size, num_kv_heads, head_dim)


@dataclass(frozen=True)
class BlockHeader:
    """The decoded fields of one header."""

    codec_id: int
    version: int
    dtype: torch.dtype
    scale_dtype: torch.dtype
    scale_layout: int
    block_shape: BlockShape
    body_bytes: int

    def pack(self) -> bytes:
        """The 32 header bytes."""
        layers, _kv, block_size, heads, head_dim = self.block_shape
        return _STRUCT.pack(
            MAGIC, self.codec_id, self.version, DTYPE_CODES[self.dtype], DTYPE_CODES[self.scale_dtype],
            self.scale_layout, layers, block_size, heads, head_dim, self.body_bytes,
        )  # fmt: skip

    @classmethod
    def unpack(cls, raw: bytes) -> BlockHeader:
        """Parse 32 header bytes.

        Raises:
            CodecFormatError: short input, a foreign magic, an unknown dtype code or nonzero
                reserved bytes.
        """
        if len(raw) < HEADER_BYTES:
            raise CodecFormatError(f"an encoded block needs a {HEADER_BYTES}-byte header, got {len(raw)} bytes")
        magic, codec_id, version, dtype, scale_dtype, layout, layers, block, heads, dim, body = (
            _STRUCT.unpack_from(raw)
        )
        if magic != MAGIC:
            raise CodecFormatError(f"encoded block magic is {magic!r}, expected {MAGIC!r}")
        if raw[9:12] != b"\0\0\0":
            raise CodecFormatError(f"encoded block has reserved header bytes {raw[9:12].hex()} (this reader: 000000)")
        for field, code in (("dtype", dtype), ("scale dtype", scale_dtype)):
            if code not in DTYPES_BY_CODE:
                raise CodecFormatError(f"encoded block has unknown {field} code {code}; known {sorted(DTYPES_BY_CODE)}")
        return cls(codec_id, version, DTYPES_BY_CODE[dtype], DTYPES_BY_CODE[scale_dtype], layout,
                   (layers, 2, block, heads, dim), body)


def encoded_size(body_bytes: int) -> int:
    """Header + body, rounded up to ``ALIGN``."""
    return -(-(HEADER_BYTES + body_bytes) // ALIGN) * ALIGN


def rows_matching(src: torch.Tensor, expected: bytes) -> torch.Tensor:
    """Per row of ``src`` (uint8 ``[n, >= 32]``, any device): do its first 32 bytes equal
    ``expected``? A bool ``[n]`` tensor on ``src``'s device; no host sync."""
    want = torch.frombuffer(bytearray(expected), dtype=torch.uint8).to(src.device)
    return (src[:, :HEADER_BYTES] == want).all(dim=1)


def mismatch(raw: bytes, expected: BlockHeader) -> str:
    """Why the header ``raw`` is refused by a reader that expects ``expected`` (for messages)."""
    try:
        found = BlockHeader.unpack(raw)
    except CodecFormatError as e:
        return str(e)
    for field in ("codec_id", "version", "dtype", "scale_dtype", "scale_layout", "block_shape", "body_bytes"):
        if getattr(found, field) != getattr(expected, field):
            return f"header {field} is {getattr(found, field)}, this reader expects {getattr(expected, field)}"
    return "header bytes differ"
