"""The KV-event batch decoder (kvstore/events/wire.py): the payload frame of every message a
subscriber, ``kvstore events`` or a router reads from a publisher it does not control.

Input: one payload. What must hold:

- ``decode_batch`` refuses it with WireError, or returns a batch that the generic decoder
  reads alike (the typed msgspec path accepts only what the generic one does, docs/kv-events.md);
- an accepted batch re-encodes with ``encode_batch`` (less what the encoder never writes:
  unknown events, kept only to be counted, and 0.34's ``lookahead_token_ids``), and that
  payload decodes to an equal batch and re-encodes to itself;
- an EventView takes the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import msgpack
import msgspec

from kvstore.events.replay_ring import Held, snapshot_batches
from kvstore.events.view import EventView
from kvstore.events.wire import (
    FULL_GROUP,
    SLIDING_WINDOW,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    EventGroup,
    UnknownEvent,
    WireError,
    _decode_generic,
    _StoredOut,
    decode_batch,
    encode_batch,
)


def _same(a: Any, b: Any) -> bool:
    """Equal, or equal but for NaNs (a NaN timestamp or field decodes to a NaN again)."""
    return a == b or repr(a) == repr(b)


def writable(batch: EventBatch) -> EventBatch:
    """``batch`` as the encoder writes it: no unknown events, no ``lookahead_token_ids``."""
    events: list[Event] = [dataclasses.replace(e, lookahead_token_ids=None) if isinstance(e, BlockStored) else e
                           for e in batch.events if not isinstance(e, UnknownEvent)]
    return dataclasses.replace(batch, events=events)


def make() -> Callable[[bytes], None]:
    def check(data: bytes) -> None:
        try:
            batch = decode_batch(data)
        except WireError:
            return
        generic = _decode_generic(data)
        assert _same(batch, generic), f"the typed and the generic decoder differ:\n{batch}\n{generic}"
        out = writable(batch)
        payload = encode_batch(out)
        again = decode_batch(payload)
        assert _same(again, out), f"a decoded batch does not survive its re-encoding:\n{out}\n{again}"
        assert encode_batch(again) == payload, "re-encoding is not a fixed point"
        EventView().apply(batch)

    return check


# ----------------------------------------------------------------------------- seeds


class _Stored34(_StoredOut, tag="BlockStored"):
    """vLLM 0.34's BlockStored: 0.32's fields (the encoder's own struct) and a sixteenth, so
    every event opens with a map16."""

    lookahead_token_ids: Any = None


def _publisher_batches() -> dict[str, EventBatch]:
    """What kvstore's publisher sends: its packing of queued items into events (hybrid groups
    included), a snapshot reply with media, a heartbeat."""
    from kvstore.events.publisher import _pack

    k = [bytes([i]) * 32 for i in range(1, 7)]
    sliding = EventGroup(1, SLIDING_WINDOW, 512)
    items = [("stored", "GPU", k[:3], [None, k[0], k[1]], 4, list(range(12)), [FULL_GROUP, sliding, FULL_GROUP]),
             ("stored", "CPU", k[3:5], [None, k[3]], 16, None, FULL_GROUP),
             ("removed", "GPU", [k[0], k[1]], [FULL_GROUP, sliding]),
             ("removed", "DISK", [k[5]], None),
             ("cleared",)]
    ts = 1764547200.25
    held: list[Held] = [("GPU", 16, [(k[0], None), (k[1], k[0]), (k[2], k[1], sliding)]), ("CPU", 16, [(k[3], None, None)])]
    snapshot = snapshot_batches(held, 42, 0, {"GPU": {"kv_cache_dtype": "int8", "block_bytes": 126720}})
    return {"publisher-hybrid": EventBatch(ts, _pack(items), 0, epoch=2**64 - 1),
            "publisher-no-epoch": EventBatch(ts, _pack(items[1:2]), 3),
            **{f"snapshot-{i}": dataclasses.replace(b, ts=ts) for i, b in enumerate(snapshot)},
            "heartbeat-media": EventBatch(ts, [], 0, epoch=7, media={"GPU": {"kv_cache_dtype": "fp8"}})}


def seeds() -> dict[str, bytes]:
    """kvstore's own batches, vLLM 0.32's optional fields, vLLM 0.34's map16 events with
    ``lookahead_token_ids``, older tagged arrays, a map batch, ints as hashes, an unknown event."""
    out = {name: encode_batch(b) for name, b in _publisher_batches().items()}
    k1, k2 = b"\x11" * 32, b"\x22" * 32
    out["doc-example"] = encode_batch(EventBatch(1764547200.5, [BlockStored([k1, k2], None, list(range(1, 9)), 4, "GPU"),
                                                                BlockRemoved([b"\x33" * 32], "CPU")], 0, epoch=42))
    out["vllm-0.32-optional-fields"] = encode_batch(EventBatch(1764547201.0, [
        BlockStored([7, 8], 6, [1, 2], 1, None, 1, "lora", [["salt", 1]], 2, SLIDING_WINDOW, 64, "local", "owner",
                    "session"),
        BlockRemoved([7], None, None, "local", "owner"), AllBlocksCleared()], None))
    out["vllm-0.34-lookahead"] = msgspec.msgpack.encode(
        [1.5, [_Stored34([k1], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=0,
                         kv_cache_spec_kind="full_attention", lookahead_token_ids=[5, 6])], 0])
    out["vllm-0.23-tagged-arrays"] = msgpack.packb(
        [2.0, [["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None, "GPU"], ["BlockRemoved", [1], "GPU"],
               ["AllBlocksCleared"]]])
    out["map-batch"] = msgpack.packb({"ts": 3, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 1})
    out["unknown-event"] = msgpack.packb([4.0, [{"type": "KVCacheOffloaded", "block_hashes": [b"x"]}], 0, {"epoch": 9}])
    out["two-element-batch"] = msgpack.packb([5.0, []])
    out["extension-without-epoch"] = msgpack.packb([6.0, [], 0, {"snapshot": True, "media": {}}])
    # a map whose keys repeat ("type", "block_size"): msgpack keeps the last of each
    stored = b"".join(msgpack.packb(x) for x in ("type", "BlockRemoved", "block_hashes", [k1], "type", "BlockStored",
                                                  "block_size", 4, "block_size", 8))
    out["repeated-map-keys"] = b"\x93" + msgpack.packb(7.0) + b"\x91\x85" + stored + b"\x00"
    return out
