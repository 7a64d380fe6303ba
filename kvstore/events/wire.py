"""The KV-event wire format: vLLM's (0.32) exactly, plus kvstore's extension element.

One ZeroMQ message is three frames: ``topic`` (UTF-8), ``seq`` (u64 big-endian), ``payload``
(msgpack). The payload is a batch array ``[ts, events, data_parallel_rank]``; each event is
a tagged msgpack map ``{"type": "BlockStored", "block_hashes": [...], ...}`` (vLLM's msgspec
structs without ``array_like``, since vllm-project/vllm#42892). kvstore appends a fourth
batch element, a map ``{"epoch": u64}`` (``"snapshot": true`` on snapshot replies; on heartbeats and
snapshots ``"media"``: what each medium holds, e.g. ``{"GPU": {"kv_cache_dtype": "int8"}}``), which
vLLM's own decoder (an ``array_like`` struct) ignores. docs/kv-events.md gives the bytes of an example.

``decode_batch`` reads both event encodings vLLM has used: tagged maps and the older tagged
arrays (``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, ...]``), and
a batch as an array of 2-4 elements or as a map.

An event names its blocks' KV group as vLLM does (``EventGroup``): ``group_idx``,
``kv_cache_spec_kind`` (``"full_attention"``, ``"sliding_window"``) and
``kv_cache_spec_sliding_window`` on ``BlockStored``, ``group_idx`` on ``BlockRemoved``; a
layout without groups is group 0, full attention, as every event said before groups existed.

The format is one module (about 420 lines) though longer than most: the event types, their map
and array encodings and both decoders must change together whenever vLLM's structs do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

import msgpack
import msgspec

GPU, CPU, DISK, REMOTE = "GPU", "CPU", "DISK", "REMOTE"
MEDIA = (GPU, CPU, DISK, REMOTE)
TIER_MEDIA = {"device": GPU, "host": CPU, "disk": DISK, "remote": REMOTE}  # kvstore tier -> medium

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay reply's end marker
SNAPSHOT_REQUEST = b"kvstore:snapshot"  # 16 bytes: never mistaken for an 8-byte start seq
MAX_PAYLOAD = 64 << 20  # a batch larger than this is refused by the decoder

BlockHash = bytes | int  # kvstore sends bytes (its full block keys); vLLM may send ints


FULL_ATTENTION, SLIDING_WINDOW = "full_attention", "sliding_window"  # vLLM's KVCacheSpecKind values


class WireError(ValueError):
    """A message that is not a KV-event batch (wrong frames, bad msgpack, wrong shapes)."""


@dataclass(frozen=True, slots=True)
class EventGroup:
    """A KV group as the events name it (vLLM's fields): ``idx`` is ``group_idx``, ``kind``
    ``kv_cache_spec_kind`` (vLLM's names: ``"full_attention"``, ``"sliding_window"``, ...),
    ``sliding_window`` ``kv_cache_spec_sliding_window`` (tokens; None unless sliding)."""

    idx: int
    kind: str | None = FULL_ATTENTION
    sliding_window: int | None = None


FULL_GROUP = EventGroup(0)  # a layout without groups: what every event said before groups


@dataclass(slots=True)
class BlockStored:
    """``block_hashes`` form one chain: each block's parent is the one before it, the first's
    is ``parent_block_hash``. ``token_ids`` are the blocks' tokens (empty where the tier does
    not know them: kvstore's host/disk/remote tiers)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = FULL_ATTENTION
    kv_cache_spec_sliding_window: int | None = None
    # vLLM's other optional fields, which kvstore sets on none of its events: locality,
    # ownership and session_id (0.32) are read and written back; 0.34's lookahead_token_ids is
    # read, never written (a 16th map entry would change every event's map header, see _StoredOut)
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: Any = None

    @property
    def group(self) -> EventGroup | None:
        """The blocks' KV group; None where the event names none."""
        if self.group_idx is None:
            return None
        return EventGroup(self.group_idx, self.kv_cache_spec_kind, self.kv_cache_spec_sliding_window)

    def set_group(self, group: EventGroup | None) -> BlockStored:
        """Name ``group`` (None: no group fields on the wire); returns self."""
        self.group_idx, self.kv_cache_spec_kind, self.kv_cache_spec_sliding_window = (
            (None, None, None) if group is None else (group.idx, group.kind, group.sliding_window))
        return self


@dataclass(slots=True)
class BlockRemoved:
    """The last copy of each of ``block_hashes`` left ``medium``."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = 0
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """The publisher holds nothing any more, on any medium."""


@dataclass(frozen=True)
class UnknownEvent:
    """An event type this decoder does not know (kept, so counts stay honest; views skip it)."""

    tag: str


Event = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


@dataclass(slots=True)
class EventBatch:
    """One payload. ``epoch`` and ``snapshot`` are kvstore's extension (None/False from vLLM)."""

    ts: float
    events: list[Event] = field(default_factory=list)
    data_parallel_rank: int | None = 0
    epoch: int | None = None
    snapshot: bool = False
    # what each medium holds, e.g. {"GPU": {"kv_cache_dtype": "int8"}}: on heartbeats and snapshots
    media: dict[str, dict[str, Any]] | None = None

    @property
    def is_heartbeat(self) -> bool:
        return not self.events and not self.snapshot


# --------------------------------------------------------------------------------- encoding

# vLLM's event structs as its encoder sees them (msgspec writes the tag first, then the fields
# in declaration order, leaving out those equal to their default): vLLM 0.32's bytes exactly.
# msgspec sizes a map's header by the struct's declared fields, not by those it writes: with
# the tag, 0.32's BlockStored has 15 entries at most (a fixmap, 0x8N), 0.34's 16 (lookahead_token_ids:
# a map16, de 00 NN, for every event). Hence BlockStored stops at session_id here.
class _Out(msgspec.Struct, tag_field="type", tag=True, omit_defaults=True, gc=False):
    pass


class _StoredOut(_Out, tag="BlockStored"):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[Any]
    block_size: int
    lora_id: Any
    medium: Any
    lora_name: Any
    extra_keys: Any = None
    group_idx: Any = None
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: Any = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None


class _RemovedOut(_Out, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: Any
    group_idx: Any = None
    locality: Any = None
    ownership: Any = None


class _ClearedOut(_Out, tag="AllBlocksCleared"):
    pass


_ENCODER = msgspec.msgpack.Encoder()


def _wire_event(event: Event) -> _Out:
    if isinstance(event, BlockStored):
        return _StoredOut(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                          event.lora_id, event.medium, event.lora_name, event.extra_keys, event.group_idx,
                          event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window, event.locality,
                          event.ownership, event.session_id)
    if isinstance(event, BlockRemoved):
        return _RemovedOut(event.block_hashes, event.medium, event.group_idx, event.locality, event.ownership)
    if isinstance(event, AllBlocksCleared):
        return _ClearedOut()
    raise TypeError(f"cannot encode {type(event).__name__}")


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of ``batch``: vLLM 0.32's bytes, then the extension element when
    ``batch`` sets any of its fields (kvstore's publisher sets ``epoch`` on every batch)."""
    body: list[Any] = [float(batch.ts), [_wire_event(e) for e in batch.events], batch.data_parallel_rank]
    if batch.epoch is not None or batch.snapshot or batch.media is not None:  # (what a decoder read, written back)
        ext: dict[str, Any] = {"epoch": batch.epoch}
        if batch.snapshot:
            ext["snapshot"] = True
        if batch.media is not None:
            ext["media"] = batch.media
        body.append(ext)
    return _ENCODER.encode(body)


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def parse_seq(frame: bytes) -> int:
    """The sequence number of an 8-byte frame; -1 for the end marker."""
    if len(frame) != 8:
        raise WireError(f"a sequence frame has 8 bytes, got {len(frame)}")
    return -1 if frame == END_SEQ else int.from_bytes(frame, "big")


# --------------------------------------------------------------------------------- decoding

# The common case, typed, decoded and checked by msgspec in C: an array batch of tagged-map
# events of the three known types, each field of the type vLLM sends, and no field this
# decoder does not know. That is a subset of what ``_decode_generic`` accepts (msgspec would
# skip an unknown key unread, garbled bytes included, and read into ``Any`` what msgpack
# refuses, such as a map keyed by an array), and it yields the same batch; anything else
# (older encodings, unknown events or fields, other types, malformed bytes) is left to
# ``_decode_generic``, which also words the error.
class _In(msgspec.Struct, tag_field="type", tag=True, forbid_unknown_fields=True, gc=False):
    pass


_Scalar = str | int | float | None  # (msgspec takes one of str and bytes in a union)


class _StoredIn(_In, tag="BlockStored"):
    block_hashes: list[bytes | int]
    block_size: Annotated[int, msgspec.Meta(ge=0)]
    parent_block_hash: bytes | int | None = None
    token_ids: list[int] = []
    medium: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list[list[_Scalar] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class _RemovedIn(_In, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _ClearedIn(_In, tag="AllBlocksCleared"):
    pass


class _ExtensionIn(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    epoch: int | None = None
    snapshot: bool = False
    media: dict[str, dict[str, _Scalar]] | None = None


class _BatchIn(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    ts: float
    events: list[_StoredIn | _RemovedIn | _ClearedIn]
    data_parallel_rank: int | None = None
    ext: _ExtensionIn | None = None


_DECODER = msgspec.msgpack.Decoder(_BatchIn)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload in either vLLM encoding (kvstore's extension included).

    Raises:
        WireError: not msgpack, or not a batch of events.
    """
    if len(payload) > MAX_PAYLOAD:
        raise WireError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    try:
        typed = _DECODER.decode(payload)
    except msgspec.MsgspecError:
        return _decode_generic(payload)
    events: list[Event] = []
    for e in typed.events:
        if type(e) is _StoredIn:
            events.append(BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.medium,
                                      e.lora_id, e.lora_name, e.extra_keys, e.group_idx, e.kv_cache_spec_kind,
                                      e.kv_cache_spec_sliding_window, e.locality, e.ownership, e.session_id,
                                      e.lookahead_token_ids))
        elif type(e) is _RemovedIn:
            events.append(BlockRemoved(e.block_hashes, e.medium, e.group_idx, e.locality, e.ownership))
        else:
            events.append(AllBlocksCleared())
    ext = typed.ext or _ExtensionIn()
    return EventBatch(typed.ts, events, typed.data_parallel_rank, ext.epoch, ext.snapshot, ext.media)


def _extension(ext: Any) -> tuple[int | None, bool, dict[str, dict[str, Any]] | None]:
    """kvstore's extension element: (epoch, snapshot, media); (None, False, None) when absent or
    not a map (a ``media`` that is not a map of maps is left out)."""
    if not isinstance(ext, dict):
        return None, False, None
    epoch = ext.get("epoch")
    media = ext.get("media")
    if not (isinstance(media, dict) and all(isinstance(k, str) and isinstance(v, dict) for k, v in media.items())):
        media = None
    return (epoch if isinstance(epoch, int) else None), ext.get("snapshot") is True, media


def _no_ext(code: int, data: bytes) -> Any:
    raise WireError(f"payload has a msgpack extension of type {code}: KV events use none")


def _no_timestamps(container: Any) -> Any:
    """(msgpack reads its timestamp extension without asking ``ext_hook``: each array and
    map is looked through instead.)"""
    items = container.items() if isinstance(container, dict) else ((v, v) for v in container)
    if any(type(k) is msgpack.Timestamp or type(v) is msgpack.Timestamp for k, v in items):
        raise WireError("payload has a msgpack timestamp: KV events use none")
    return container


def _decode_generic(payload: bytes) -> EventBatch:
    """``decode_batch`` for any payload: every encoding vLLM has used, and the error's words."""
    try:
        doc = msgpack.unpackb(payload, raw=False, strict_map_key=False, ext_hook=_no_ext, list_hook=_no_timestamps,
                              object_hook=_no_timestamps)
    except WireError:
        raise
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireError(f"payload is not msgpack: {exc}") from None
    except TypeError as exc:  # a map keyed by an array or a map: msgpack, but no batch
        raise WireError(f"payload has a map with an unhashable key: {exc}") from None
    if isinstance(doc, dict):
        ts, events, rank, ext = doc.get("ts"), doc.get("events"), doc.get("data_parallel_rank"), None
    elif isinstance(doc, list) and len(doc) >= 2:
        ts, events = doc[0], doc[1]
        rank = doc[2] if len(doc) > 2 else None
        ext = doc[3] if len(doc) > 3 else None
    else:
        raise WireError(f"a batch is [ts, events, rank], got {type(doc).__name__} of {_size(doc)}")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise WireError(f"batch timestamp must be a number, got {ts!r:.40}")
    if not isinstance(events, list):
        raise WireError(f"batch events must be an array, got {type(events).__name__}")
    if rank is not None and not isinstance(rank, int):
        raise WireError(f"data_parallel_rank must be an int or nil, got {rank!r:.40}")
    epoch, snapshot, media = _extension(ext)
    return EventBatch(float(ts), [_decode_event(e, i) for i, e in enumerate(events)], rank, epoch, snapshot, media)


_STORED_ORDER = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                 "locality", "ownership", "session_id", "lookahead_token_ids")
_REMOVED_ORDER = ("block_hashes", "medium", "group_idx", "locality", "ownership")


def _decode_event(raw: Any, i: int) -> Event:
    if isinstance(raw, dict):  # tagged map (vLLM since #42892, kvstore)
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:  # tagged array (older vLLM): positions are fields
        tag = raw[0]
        order = _STORED_ORDER if tag == "BlockStored" else _REMOVED_ORDER if tag == "BlockRemoved" else ()
        fields = dict(zip(order, raw[1:], strict=False))
    else:
        raise WireError(f"event #{i} is neither a tagged map nor a tagged array: {raw!r:.60}")
    if not isinstance(tag, str):
        raise WireError(f"event #{i} has no string tag: {raw!r:.60}")
    if tag == "BlockStored":
        hashes = _hashes(fields.get("block_hashes"), i)
        tokens = fields.get("token_ids", [])
        block_size = fields.get("block_size")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise WireError(f"event #{i}: token_ids must be an array of ints")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 0:
            raise WireError(f"event #{i}: block_size must be an int >= 0, got {block_size!r:.40}")
        parent = fields.get("parent_block_hash")
        if parent is not None and not isinstance(parent, bytes | int):
            raise WireError(f"event #{i}: parent_block_hash must be bytes, an int or nil")
        return BlockStored(hashes, parent, tokens, block_size, _medium(fields, i), fields.get("lora_id"),
                           fields.get("lora_name"), fields.get("extra_keys"), _int(fields, "group_idx", i),
                           _text(fields, "kv_cache_spec_kind", i), _int(fields, "kv_cache_spec_sliding_window", i),
                           fields.get("locality"), fields.get("ownership"), fields.get("session_id"),
                           fields.get("lookahead_token_ids"))
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(fields.get("block_hashes"), i), _medium(fields, i), _int(fields, "group_idx", i),
                            fields.get("locality"), fields.get("ownership"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return UnknownEvent(tag)


def _hashes(value: Any, i: int) -> list[BlockHash]:
    if not isinstance(value, list) or not all(isinstance(h, bytes | int) and not isinstance(h, bool)
                                              for h in value):
        raise WireError(f"event #{i}: block_hashes must be an array of bytes or ints")
    return value


def _medium(fields: dict[str, Any], i: int) -> str | None:
    medium = fields.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise WireError(f"event #{i}: medium must be a string or nil, got {medium!r:.40}")
    return medium


def _int(fields: dict[str, Any], name: str, i: int) -> int | None:
    """An optional int field (a group's index or window): what a consumer keys its view by."""
    value = fields.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise WireError(f"event #{i}: {name} must be an int or nil, got {value!r:.40}")
    return value


def _text(fields: dict[str, Any], name: str, i: int) -> str | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, str):
        raise WireError(f"event #{i}: {name} must be a string or nil, got {value!r:.40}")
    return value


def _size(doc: Any) -> str:
    return f"{len(doc)} elements" if isinstance(doc, list | dict) else "one value"
