"""The remote tier's reader of block values: the bytes a GET from Redis returns for a block
(kvstore/tiers/remote/codec.py), as RemoteReads checks them on a lookup and a read.

Anyone can write a value under a block's name, so every byte of it is untrusted. Input: one
byte picks the key the value is read under (three keys, two lengths), the path (a read alone,
or a lookup and the read that takes its kept value) and how the reply arrives (as GET's own
reader hands it over, or as redis-py read it after an ASK); the rest is the value.
What must hold:

- ``codec.decode`` refuses with one of its reasons, or accepts a value that is exactly
  ``encode(key, layout, payload, owner)`` of what it returned (the format is canonical), and
  that no other key, layout or payload length accepts;
- a read delivers a block exactly when ``decode`` accepts its value, and then the payload's
  bytes, nothing else; a refused value is a miss, counted under ``corrupt`` with its reason,
  deleted, and hinted missing; hits + misses is the blocks asked for.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from kvstore.tiers.remote import codec
from kvstore.tiers.remote.counters import RemoteCounters
from kvstore.tiers.remote.reads import RemoteReads
from kvstore.tiers.remote.topology import _as_value

PAYLOAD = 48
LAYOUT = codec.layout_digest("L2-H2-D64-B16-float16-tp0of1")
OTHER_LAYOUT = codec.layout_digest("L2-H2-D64-B16-float16-tp1of2")
KEYS = (hashlib.sha256(b"a").digest(), hashlib.sha256(b"b").digest(), hashlib.sha256(b"c").digest()[:16])
OWNER = hashlib.sha256(b"tenant").digest()[: codec.OWNER_BYTES]
REASONS = {"magic", "version", "length", "layout", "key", "checksum"}


def payload_of(key: bytes) -> bytes:
    """The block put under ``key`` (derived from it, so a read of another block's bytes shows)."""
    return hashlib.shake_128(key).digest(PAYLOAD)


def _check_codec(value: bytes, key: bytes) -> str:
    """``decode``'s verdict on ``value`` for ``key`` ("" accepted, else its reason), checked."""
    payload, reason = codec.decode(value, key, LAYOUT, PAYLOAD)
    if payload is None:
        assert reason in REASONS, f"unknown reason {reason!r}"
        return reason
    assert reason == "", reason
    assert len(payload) == PAYLOAD
    owner = codec.owner_of(value)
    assert codec.encode(key, LAYOUT, memoryview(bytes(payload)), owner) == value, "an accepted value is not canonical"
    assert codec.is_owned(value, owner)
    for other in KEYS:
        if other != key:
            assert codec.decode(value, other, LAYOUT, PAYLOAD)[0] is None, "a value bound to one key read under another"
    assert codec.decode(value, key, OTHER_LAYOUT, PAYLOAD)[0] is None, "a value read under another layout"
    assert codec.decode(value, key, LAYOUT, PAYLOAD + 1)[0] is None, "a value read at another payload length"
    return ""


def make() -> Callable[[bytes], None]:
    def check(data: bytes) -> None:
        if not data:
            return
        key = KEYS[(data[0] & 0x0F) % len(KEYS)]
        via_lookup, aside = bool(data[0] & 0x10), bool(data[0] & 0x20)
        value = data[1:]
        reason = _check_codec(value, key)
        accepted = reason == ""

        deleted: list[bytes] = []

        def ask(names: list[bytes], command: str, value_bytes: int | None = None) -> list[Any]:
            if command == "DEL":
                deleted.extend(names)
                return [1] * len(names)
            assert command == "GET" and value_bytes == codec.header_bytes(len(key)) + PAYLOAD, (command, value_bytes)
            # GET's reader gives memory of its own; an ASK followed, the bytes redis-py read
            return [_as_value(bytes(value) if aside else bytearray(value), value_bytes)]

        counters = RemoteCounters()
        reads = RemoteReads(ask, lambda keys, _tags: [b"name:" + k for k in keys], counters, LAYOUT, PAYLOAD,
                            hint_ttl_s=60.0)
        if via_lookup:
            assert reads.lookup([key]) == int(accepted)
            assert len(reads.kept) == int(accepted)
        out = bytearray(PAYLOAD + 3)
        owners: list[bytes | None] = [None]
        ok = reads.get([key], [out], None, bool(data[0] & 0x40), owners)
        assert ok == [accepted], f"read {ok} of a value decode() called {reason or 'valid'}"
        assert counters.hits == int(accepted) and counters.hits + counters.misses == 1
        if accepted:
            assert bytes(out[:PAYLOAD]) == value[-PAYLOAD:] and out[PAYLOAD:] == bytes(3)
            assert owners == [codec.owner_of(value)] and counters.bytes_read == PAYLOAD
            assert counters.kept_used == int(via_lookup) and not deleted
        else:
            assert out == bytes(len(out)), "a refused value wrote into the caller's memory"
            assert owners == [None] and counters.bytes_read == 0
            assert counters.error_kinds["corrupt"] == 1 == counters.corrupt_reasons.get(reason), counters
            assert deleted == [b"name:" + key], deleted
        assert counters.errors == sum(counters.error_kinds.values())
        assert reads.hints.known([key]) == [accepted]

    return check


def seeds() -> dict[str, bytes]:
    """A valid value of each key (one with an owner), each read under another key, one of
    another layout, an old version, torn ones, and a flipped payload byte."""
    values = {f"key{i}": codec.encode(k, LAYOUT, memoryview(payload_of(k)), OWNER if i == 0 else codec.NO_OWNER)
              for i, k in enumerate(KEYS)}
    out: dict[str, bytes] = {}
    for i, (name, value) in enumerate(values.items()):
        out[f"{name}-read"] = bytes([i]) + value
        out[f"{name}-lookup-then-read"] = bytes([0x10 | i]) + value
        out[f"{name}-under-key{(i + 1) % 3}"] = bytes([(i + 1) % 3]) + value
        out[f"{name}-leading-after-ask"] = bytes([0x60 | i]) + value
    good = values["key0"]
    flipped = bytearray(good)
    flipped[-1] ^= 1
    v1 = bytearray(good)
    v1[4:6] = (1).to_bytes(2, "big")
    out["other-layout"] = b"\0" + codec.encode(KEYS[0], OTHER_LAYOUT, memoryview(payload_of(KEYS[0])))
    out["version1"] = b"\0" + bytes(v1)
    out["torn"] = b"\0" + good[:-5]
    out["torn-after-ask"] = b"\x20" + good[:-5]
    out["header-only"] = b"\0" + good[: codec.FIXED.size]
    out["flipped-payload"] = b"\x10" + bytes(flipped)
    out["empty-value"] = b"\0"
    return out
