"""Catalog record encoding: the bytes an LMDB value holds for one block (docs/storage-format.md).

Value of ``blocks[key]`` (little-endian, packed, 45-byte header then two UTF-8 strings)::

    off  size  field
      0     1  format version (1)
      1     8  slot (u64)
      9    16  checksum: xxh3_128 digest of key || payload (big-endian, as xxhash's digest())
     25     8  created (f64, Unix seconds)
     33     8  last_access (f64, Unix seconds)
     41     2  layout id length L (u16)
     43     2  tenant length T (u16)
     45     L  layout id (UTF-8)
   45+L     T  tenant (UTF-8)
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

from kvstore.tiers.errors import TierError

FORMAT_VERSION = 1
MAX_KEY_BYTES = 64
MAX_NAME_BYTES = 255  # tenant and layout id, UTF-8 encoded

# version u8 | slot u64 | checksum 16s | created f64 | last_access f64 | layout len u16 | tenant len u16
_HEADER = struct.Struct("<BQ16sddHH")
LAST_ACCESS_OFFSET = 1 + 8 + 16 + 8
GEOMETRY = struct.Struct("<4sIQQQ")  # magic, format version, payload_bytes, slot_bytes, num_slots
MAGIC = b"KVDT"


class Record(NamedTuple):
    """One decoded catalog value."""

    slot: int
    checksum: bytes
    layout_id: str
    tenant: str
    created: float
    last_access: float


def encode_record(record: Record) -> bytes:
    """Encode a catalog value (the key is the block key itself)."""
    layout = record.layout_id.encode()
    tenant = record.tenant.encode()
    head = _HEADER.pack(
        FORMAT_VERSION,
        record.slot,
        record.checksum,
        record.created,
        record.last_access,
        len(layout),
        len(tenant),
    )
    return head + layout + tenant


def decode_record(value: bytes) -> Record:
    """Decode a catalog value; raises TierError on a foreign version or a truncated value."""
    if len(value) < _HEADER.size:
        raise TierError(f"catalog value of {len(value)} bytes is shorter than the {_HEADER.size}-byte header")
    version, slot, checksum, created, last_access, layout_len, tenant_len = _HEADER.unpack_from(value)
    if version != FORMAT_VERSION or len(value) != _HEADER.size + layout_len + tenant_len:
        raise TierError(
            f"catalog value has version {version} and {len(value)} bytes; expected version {FORMAT_VERSION}"
        )
    layout = value[_HEADER.size : _HEADER.size + layout_len].decode()
    tenant = value[_HEADER.size + layout_len :].decode()
    return Record(slot, checksum, layout, tenant, created, last_access)


def check_keys(keys: Sequence[bytes]) -> None:
    """Raise ValueError unless every key is ``bytes`` of 1 to 64 bytes."""
    for key in keys:
        if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"keys must be bytes of 1 to {MAX_KEY_BYTES} bytes, got {key!r:.80}")


def check_name(field: str, value: str) -> None:
    """Raise ValueError unless ``value`` is a str of at most 255 bytes in UTF-8."""
    try:
        size = len(value.encode())
    except (AttributeError, UnicodeEncodeError):
        size = -1
    if not isinstance(value, str) or not 0 <= size <= MAX_NAME_BYTES:
        raise ValueError(f"{field} must be a str of at most {MAX_NAME_BYTES} UTF-8 bytes, got {value!r:.80}")
