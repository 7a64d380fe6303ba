"""The remote tier's formats without a server: URLs, key names, the value header."""

from __future__ import annotations

import hashlib

import pytest
from redis.crc import key_slot

from kvstore.tiers.remote import codec
from kvstore.tiers.remote.naming import block_name, group_tags, name_pattern
from kvstore.tiers.remote.url import parse_url


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_urls_parse_every_scheme() -> None:
    one = parse_url("redis://127.0.0.1:7000/2")
    assert (one.nodes, one.cluster, one.tls, one.db) == ((("127.0.0.1", 7000),), False, False, 2)
    seeds = parse_url("rediss+cluster://u:p%40ss@a:1,b:2,[::1]:3")
    assert seeds.cluster and seeds.tls and seeds.nodes == (("a", 1), ("b", 2), ("::1", 3))
    assert (seeds.username, seeds.password) == ("u", "p@ss")
    assert parse_url("redis://host").nodes == (("host", 6379),)
    assert parse_url("rediss://h:1").tls and not parse_url("redis+cluster://h:1").tls


@pytest.mark.parametrize("url", [
    "http://h:1", "redis://", "redis://h:0", "redis://h:x", "redis://a:1,b:2", "redis+cluster://h:1/3",
    "redis://h:1?db=2", "redis://h:1/x",
])
def test_bad_urls_are_value_errors(url: str) -> None:
    with pytest.raises(ValueError, match="remote URL"):
        parse_url(url)


def test_passwords_never_show() -> None:
    secret = "s3cr3t-pw"
    url = parse_url(f"redis+cluster://admin:{secret}@h:1,h:2")
    for text in (repr(url), str(url), url.redacted(), f"{url!r}"):
        assert secret not in text and "***" in text
    with pytest.raises(ValueError) as e:
        parse_url(f"redis://admin:{secret}@h:notaport")
    assert secret not in str(e.value)


def test_names_carry_version_run_length_and_tag() -> None:
    k = key(0)
    assert block_name(k, k) == b"kvstore:v2:g1:{" + k.hex().encode() + b"}"
    assert block_name(k, key(1), "p", 4) == b"p:v2:g4:{" + key(1).hex().encode() + b"}:" + k.hex().encode()
    # with G=4 the blocks of one group share a slot; with G=1 a chain spreads
    keys = [key(i) for i in range(16)]
    tags = group_tags(keys, 4)
    slots = [key_slot(block_name(k, t, run_length=4)) for k, t in zip(keys, tags, strict=True)]
    assert all(len(set(slots[g : g + 4])) == 1 for g in range(0, 16, 4))
    assert len({key_slot(block_name(k, k)) for k in keys}) > 8


def test_group_tags_mid_chain_needs_the_head() -> None:
    keys = [key(i) for i in range(10)]
    assert group_tags(keys[5:], 4, first_depth=5, head=keys[4]) == group_tags(keys, 4)[5:]
    assert group_tags(keys[4:], 4, first_depth=4) == group_tags(keys, 4)[4:]
    with pytest.raises(ValueError, match="group head"):
        group_tags(keys[5:], 4, first_depth=5)
    assert group_tags(keys[3:], 1, first_depth=3) == keys[3:]


def test_codec_round_trip_and_every_rejection() -> None:
    layout, other = codec.layout_digest("L2-H1"), codec.layout_digest("L3-H1")
    payload = bytes(range(256)) * 8
    value = bytes(codec.encode(key(0), layout, memoryview(payload)))
    assert len(value) == codec.header_bytes(32) + len(payload) == 96 + len(payload)
    got, reason = codec.decode(value, key(0), layout, len(payload))
    assert reason == "" and got is not None and bytes(got) == payload
    assert codec.owner_of(value) == codec.NO_OWNER  # none recorded

    def reason_of(v: bytes, k: bytes = key(0), lay: bytes = layout, n: int = len(payload)) -> str:
        found, why = codec.decode(v, k, lay, n)
        assert found is None
        return why

    flipped = bytearray(value)
    flipped[-100] ^= 1
    assert reason_of(bytes(flipped)) == "checksum"
    assert reason_of(value[:-1]) == "length"
    assert reason_of(value[:10]) == "length"
    assert reason_of(b"XXXX" + value[4:]) == "magic"
    assert reason_of(value[:4] + b"\x00\x01" + value[6:]) == "version"  # a v1 value: never read
    assert reason_of(value, lay=other) == "layout"
    assert reason_of(value, k=key(1)) == "key"
    assert reason_of(value, n=len(payload) - 1) == "length"
    header = bytearray(value)
    header[20] ^= 1  # inside the layout digest: caught by the digest compare
    assert reason_of(bytes(header)) == "layout"


def test_the_owner_is_in_the_checksummed_header() -> None:
    layout, owner, other = codec.layout_digest("L2-H1"), b"\x01" * 16, b"\x02" * 16
    payload = bytes(range(256)) * 4
    value = codec.encode(key(0), layout, memoryview(payload), owner)
    assert value[:4] == b"KVRB" and value[4:6] == b"\x00\x02" and value[32:48] == owner
    assert value[48:80] == key(0) and len(value) == 96 + len(payload)
    assert codec.owner_of(value) == owner
    assert codec.is_owned(value[: codec.FIXED.size], owner) and not codec.is_owned(value, other)
    assert not codec.is_owned(value[:40], owner)  # too short to say
    forged = bytearray(value)
    forged[32:48] = other  # another owner written over it: the checksum no longer holds
    assert codec.decode(bytes(forged), key(0), layout, len(payload)) == (None, "checksum")
    with pytest.raises(ValueError, match="16 bytes"):
        codec.encode(key(0), layout, memoryview(payload), b"short")


def test_the_sweep_pattern_matches_this_format_only_and_escapes_globs() -> None:
    assert name_pattern("kvstore") == b"kvstore:v2:g*"
    assert name_pattern("a*b?[c]") == b"a\\*b\\?\\[c\\]:v2:g*"
