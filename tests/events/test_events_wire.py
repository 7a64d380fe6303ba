"""The wire format: golden bytes from docs/kv-events.md, vLLM's own decoder on our bytes, and
our decoder on both encodings vLLM has used (tagged maps, tagged arrays)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvstore.events.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
    WireError,
    _decode_generic,
    decode_batch,
    encode_batch,
    parse_seq,
    seq_frame,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "kv-events.md"
K1, K2, K3 = b"\x11" * 32, b"\x22" * 32, b"\x33" * 32
EXAMPLE = EventBatch(1764547200.5, [BlockStored([K1, K2], None, list(range(1, 9)), 4, "GPU"),
                                    BlockRemoved([K3], "CPU")], 0, epoch=42)


def _vllm() -> Any:
    """vLLM's own types (tests/events/vllm_types.py), declared with msgspec as vLLM does."""
    import vllm_types

    return vllm_types


def _doc_golden() -> bytes:
    text = DOC.read_text()
    block = re.search(r"<!-- golden:begin -->\n```\n(.*?)```\n<!-- golden:end -->", text, re.S)
    assert block, "docs/kv-events.md lost its golden example"
    return bytes.fromhex(block.group(1).replace("\n", " "))


def test_encoder_writes_the_documented_bytes() -> None:
    golden = _doc_golden()
    assert encode_batch(EXAMPLE) == golden
    assert f"{len(golden)} bytes" in DOC.read_text()
    assert decode_batch(golden) == EXAMPLE


def test_frames_are_vllms() -> None:
    assert seq_frame(7) == b"\x00" * 7 + b"\x07"
    assert parse_seq(seq_frame(2**64 - 2)) == 2**64 - 2
    assert END_SEQ == b"\xff" * 8 and parse_seq(END_SEQ) == -1
    with pytest.raises(WireError, match="8 bytes"):
        parse_seq(b"\x00" * 4)


def test_vllm_decoder_reads_our_batches_and_we_write_its_bytes() -> None:
    v = _vllm()
    ours = EventBatch(3.25, [BlockStored([K1, K2], K3, list(range(8)), 4, "DISK"), BlockRemoved([K1], "GPU"),
                             AllBlocksCleared()], 0, epoch=2**64 - 1, snapshot=True)
    got = v.msgspec.msgpack.Decoder(v.KVEventBatch).decode(encode_batch(ours))  # the extension is ignored
    assert got.ts == 3.25 and got.data_parallel_rank == 0
    stored, removed, cleared = got.events
    assert stored.block_hashes == [K1, K2] and stored.parent_block_hash == K3 and stored.medium == "DISK"
    assert stored.token_ids == list(range(8)) and stored.block_size == 4 and stored.group_idx == 0
    assert removed.block_hashes == [K1] and removed.medium == "GPU"
    assert isinstance(cleared, v.VCleared)
    # without the extension element our payload is byte for byte what vLLM's encoder writes
    plain = EventBatch(3.25, ours.events, 0)
    theirs = v.KVEventBatch(ts=3.25, data_parallel_rank=0, events=[
        v.VStored([K1, K2], K3, list(range(8)), 4, None, "DISK", None, group_idx=0,
                  kv_cache_spec_kind="full_attention"),
        v.VRemoved([K1], "GPU", group_idx=0), v.VCleared()])
    assert encode_batch(plain) == v.msgspec.msgpack.encode(theirs)


def test_decoder_reads_vllm_map_events_from_vllms_encoder() -> None:
    v = _vllm()
    payload = v.msgspec.msgpack.encode(v.KVEventBatch(ts=1.0, data_parallel_rank=1, events=[
        v.VStored([123, 456], None, [1, 2, 3, 4], 2, None, "GPU", None, extra_keys=[None, None], group_idx=0),
        v.VRemoved([123], None), v.VCleared()]))
    batch = decode_batch(payload)
    assert batch.epoch is None and not batch.snapshot and batch.data_parallel_rank == 1
    assert batch.events[0] == BlockStored([123, 456], None, [1, 2, 3, 4], 2, "GPU", None, None, [None, None], 0, None)
    assert batch.events[1] == BlockRemoved([123], None, None)
    assert batch.events[2] == AllBlocksCleared()


def test_decoder_reads_legacy_tagged_arrays() -> None:
    v = _vllm()
    payload = v.msgspec.msgpack.encode(v.OldBatch(2.0, [v.OldStored([9], 8, [5, 6], 2, None, "CPU"),
                                                        v.OldRemoved([9])]))
    assert msgpack.unpackb(payload)[1][0][0] == "BlockStored"  # really the array encoding
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == [BlockStored([9], 8, [5, 6], 2, "CPU", None, None, None, None, None),
                            BlockRemoved([9], None, None)]


def test_decoder_takes_mixed_batches_maps_and_unknown_events() -> None:
    raw = msgpack.packb({"ts": 1, "events": [["AllBlocksCleared"], {"type": "BlockRemoved", "block_hashes": [b"x"],
                                                                       "medium": "GPU"},
                                             {"type": "SomethingNew", "x": 1}], "data_parallel_rank": 0})
    batch = decode_batch(raw)
    assert batch.events == [AllBlocksCleared(), BlockRemoved([b"x"], "GPU", None), UnknownEvent("SomethingNew")]


@pytest.mark.parametrize("payload, match", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb(5), "a batch is"),
    (msgpack.packb(["t", []]), "timestamp"),
    (msgpack.packb([1.0, {}]), "events must be an array"),
    (msgpack.packb([1.0, [7]]), "neither a tagged map"),
    (msgpack.packb([1.0, [{"block_hashes": []}]]), "no string tag"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": ["s"]}]]), "block_hashes"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [], "block_size": -1}]]), "block_size"),
    (msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [], "medium": 3}]]), "medium"),
    (msgpack.packb([1.0, [], "zero"]), "data_parallel_rank"),
    (bytes.fromhex("93019181910101") + b"\x00", "unhashable key"),  # a map keyed by an array
])
def test_decoder_refuses_malformed_payloads(payload: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        decode_batch(payload)


def test_decoder_turns_every_flipped_byte_into_a_batch_or_a_wire_error() -> None:
    """Random corruption of valid payloads never escapes as anything but WireError (msgpack
    itself raises TypeError for a map keyed by an array, ValueError, FormatError...)."""
    import random

    from kvstore.events.view import EventView

    payloads = [encode_batch(EXAMPLE), encode_batch(EventBatch(2.0, [AllBlocksCleared()], None, epoch=1))]
    rng = random.Random(7)
    decoded = refused = 0
    for _ in range(20_000):
        payload = bytearray(rng.choice(payloads))
        for _ in range(rng.randint(1, 3)):
            payload[rng.randrange(len(payload))] = rng.randrange(256)
        try:
            batch = decode_batch(bytes(payload))
        except WireError:
            refused += 1
            with pytest.raises(WireError):  # the generic decoder refuses it too
                _decode_generic(bytes(payload))
            continue
        assert batch == _decode_generic(bytes(payload))  # the typed fast path reads it alike
        EventView().apply(batch)  # what decodes, a sink takes
        decoded += 1
    assert decoded > 0 and refused > 0


def test_our_batches_take_the_typed_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvstore's own batches (and vLLM 0.32's) are read by msgspec's typed decoder alone; the
    generic one is for older encodings, unknown events and errors."""
    from kvstore.events import wire

    def no_generic(payload: bytes) -> EventBatch:
        raise AssertionError("the generic decoder ran")

    monkeypatch.setattr(wire, "_decode_generic", no_generic)
    batches = [EXAMPLE, EventBatch(2.0, [AllBlocksCleared()], None, epoch=1, snapshot=True),
               EventBatch(3.0, [BlockStored([7, 8], 6, [], 16, None, 1, "lora", [["a", 1]], 2, "sliding_window", 64)],
                          3), EventBatch(4.0, [], 0)]
    for batch in batches:
        assert decode_batch(encode_batch(batch)) == batch


def _event_maps() -> Any:
    """Tagged-map events as a producer might write them: fields missing, extra or of the
    wrong type, unknown tags, older tagged arrays among them."""
    from hypothesis import strategies as st

    hashes = st.lists(st.one_of(st.binary(max_size=4), st.integers(-5, 2**64 - 1), st.booleans(), st.text(max_size=2)),
                      max_size=3)
    anything = st.one_of(st.none(), st.integers(-3, 3), st.text(max_size=3), st.booleans(), st.floats(allow_nan=False))
    stored = st.fixed_dictionaries(
        {"type": st.just("BlockStored")},
        optional={"block_hashes": hashes, "parent_block_hash": st.one_of(st.none(), st.binary(max_size=3),
                                                                            st.integers(0, 9), st.text(max_size=2)),
                  "token_ids": st.lists(st.one_of(st.integers(-3, 70000), st.booleans()), max_size=4),
                  "block_size": st.one_of(st.integers(-2, 64), st.booleans(), st.none()),
                  "medium": st.one_of(st.sampled_from(["GPU", "CPU"]), st.none(), st.integers(0, 2)),
                  "lora_id": anything, "lora_name": anything, "group_idx": anything, "extra": anything})
    removed = st.fixed_dictionaries({"type": st.just("BlockRemoved")},
                                    optional={"block_hashes": hashes, "medium": anything, "group_idx": anything})
    others = st.one_of(st.just({"type": "AllBlocksCleared"}), st.just({"type": "Other", "x": 1}),
                       st.just(["BlockRemoved", [b"k"], "CPU"]), st.just({"no": "tag"}))
    return st.one_of(stored, removed, others)


def test_the_typed_and_generic_decoders_agree_on_any_batch() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    ext = st.one_of(st.none(), st.fixed_dictionaries({}, optional={"epoch": st.one_of(st.integers(0, 2**64 - 1),
                                                                                       st.text(max_size=2)),
                                                                   "snapshot": st.booleans()}), st.integers(0, 3))
    batches = st.tuples(st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(0, 2**40),
                                  st.text(max_size=2)),
                        st.lists(_event_maps(), max_size=4), st.one_of(st.none(), st.integers(-1, 4), st.booleans()),
                        ext, st.integers(2, 5))

    @settings(max_examples=400, deadline=None)
    @given(batches)
    def check(parts: tuple[Any, ...]) -> None:
        payload = msgpack.packb(list(parts[:4])[: parts[4]], use_bin_type=True)
        try:
            expected = _decode_generic(payload)
        except WireError:
            with pytest.raises(WireError):
                decode_batch(payload)
            return
        assert decode_batch(payload) == expected

    check()
