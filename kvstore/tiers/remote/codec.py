"""The value of one block in Redis: a small header, then the raw payload.

    offset  size  field
    0       4     magic b"KVRB"
    4       2     format version (2), big-endian
    6       2     key length K, big-endian
    8       8     payload length P, big-endian
    16      16    layout digest: xxh3_128 of the layout fingerprint text
    32      16    owner: the writer's tenant tag (16 zero bytes: none recorded)
    48      K     the block key
    48+K    16    checksum: xxh3_128 (seed 0) over bytes [0, 48+K) followed by the payload
    64+K    P     payload

The checksum covers the header and the key, so a value stored under another name, of another
layout, torn, truncated or flipped fails like a corrupt one. Every failure has a reason name;
the tier counts it, deletes the value and reports a miss. The owner lets a sweep find every
value of one tenant by reading the first ``FIXED.size`` bytes of each (``is_owned``), and a
reader learn whose block it promotes (``owner_of``).
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"KVRB"
VERSION = 2
FIXED = struct.Struct(">4sHHQ16s16s")
CHECKSUM_BYTES = 16
MAX_KEY_BYTES = 64
OWNER_BYTES = 16
NO_OWNER = bytes(OWNER_BYTES)
OWNER_AT = 32  # offset of the owner in a value


def layout_digest(layout_id: str) -> bytes:
    """16 bytes naming a layout fingerprint (``KVLayout.fingerprint()`` text)."""
    return xxhash.xxh3_128(layout_id.encode()).digest()


def header_bytes(key_bytes: int) -> int:
    """Bytes before the payload for a key of ``key_bytes`` bytes."""
    return FIXED.size + key_bytes + CHECKSUM_BYTES


def encode(key: bytes, layout: bytes, payload: memoryview, owner: bytes = NO_OWNER) -> bytes:
    """One value: header + a copy of ``payload`` (one pass over it to hash, one to copy; the
    copy is the snapshot a write-behind needs anyway: the caller's slot may be reused).
    ``owner``: the tenant tag of the block's writer (OWNER_BYTES)."""
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"block keys are 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
    if len(owner) != OWNER_BYTES:
        raise ValueError(f"an owner tag is {OWNER_BYTES} bytes, got {len(owner)}")
    head = FIXED.pack(MAGIC, VERSION, len(key), payload.nbytes, layout, owner) + key
    hasher = xxhash.xxh3_128(head)
    hasher.update(payload)
    return b"".join((head, hasher.digest(), payload))


def decode(value: bytes | memoryview, key: bytes, layout: bytes, payload_bytes: int) -> tuple[memoryview | None, str]:
    """The payload of ``value`` if it is exactly block ``key`` of ``layout`` (checked where it
    lies: nothing is copied).

    Returns:
        ``(payload view, "")`` when every field and the checksum agree; else ``(None, reason)``
        with reason one of magic, version, length, layout, key, checksum.
    """
    head = FIXED.size + len(key)
    if len(value) < FIXED.size:
        return None, "length"
    magic, version, key_len, n, digest, _owner = FIXED.unpack_from(value, 0)
    if magic != MAGIC:
        return None, "magic"
    if version != VERSION:
        return None, "version"
    if n != payload_bytes or key_len != len(key) or len(value) != head + CHECKSUM_BYTES + n:
        return None, "length"
    if digest != layout:
        return None, "layout"
    view = memoryview(value)
    if view[FIXED.size : head] != key:
        return None, "key"
    hasher = xxhash.xxh3_128(view[:head])
    payload = view[head + CHECKSUM_BYTES :]
    hasher.update(payload)
    if hasher.digest() != view[head : head + CHECKSUM_BYTES]:
        return None, "checksum"
    return payload, ""


def owner_of(value: bytes | memoryview) -> bytes:
    """The owner tag of a value ``decode`` accepted."""
    return bytes(value[OWNER_AT : OWNER_AT + OWNER_BYTES])


def is_owned(head: bytes | memoryview, owner: bytes) -> bool:
    """Whether ``head`` (at least the first ``FIXED.size`` bytes of a value) opens a value of
    this format owned by ``owner``. A sweep deletes by this answer alone: the payload and its
    checksum are not read (a torn value of that owner goes too)."""
    if len(head) < FIXED.size:
        return False
    magic, version, _key_len, _n, _digest, found = FIXED.unpack_from(head, 0)
    return magic == MAGIC and version == VERSION and found == owner
