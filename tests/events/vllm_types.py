"""vLLM's KV-event types, declared as vLLM declares them (msgspec), to decode and encode with
vLLM's own machinery in the wire tests. Imported only where msgspec is installed.

``KVEventBatch`` and the ``V*`` events: vLLM 0.32 (an array-like batch, tagged-map events).
``KVEventBatch34`` and the ``V*34`` events: vLLM 0.34, which adds ``lookahead_token_ids`` (its
position here is assumed: last; map-encoded events are read by name, so it matters only to
the map header, which a 16th field makes a map16).
``OldBatch`` and the ``Old*`` events: vLLM 0.9 - 0.23 (tagged arrays).
"""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class VRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[VStored | VRemoved | VCleared]


class VStored34(VStored, tag="BlockStored"):
    lookahead_token_ids: list[int] | None = None


class VRemoved34(VRemoved, tag="BlockRemoved"):
    pass


class KVEventBatch34(EventBatch):
    events: list[VStored34 | VRemoved34 | VCleared]


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class OldStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
