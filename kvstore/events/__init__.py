"""KV events: what each tier holds, as a ZeroMQ stream in vLLM's wire format (docs/kv-events.md).

Publish with ``EventPublisher(EventsConfig(endpoint))``; follow with ``Subscriber(endpoint,
replay_endpoint=...)``, whose ``sink`` (an ``EventView``) holds each medium's block set and
each block's KV group (``EventGroup``; ``event_groups(layout)`` names a layout's groups).
"""

from __future__ import annotations

from kvstore.events.config import EventsConfig, replay_endpoint_for
from kvstore.events.groups import event_groups, reconciled_hits
from kvstore.events.publisher import EventPublisher
from kvstore.events.sinks import CallbackSink, FanOut
from kvstore.events.subscriber import Subscriber
from kvstore.events.view import EventView
from kvstore.events.wire import (
    CPU,
    DISK,
    FULL_ATTENTION,
    FULL_GROUP,
    GPU,
    MEDIA,
    REMOTE,
    SLIDING_WINDOW,
    TIER_MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventGroup,
    UnknownEvent,
    WireError,
    decode_batch,
    encode_batch,
)

__all__ = [
    "CPU", "DISK", "FULL_ATTENTION", "FULL_GROUP", "GPU", "MEDIA", "REMOTE", "SLIDING_WINDOW", "TIER_MEDIA",
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "CallbackSink", "EventBatch", "EventGroup", "EventPublisher",
    "EventView", "EventsConfig", "FanOut", "Subscriber", "UnknownEvent", "WireError", "decode_batch",
    "encode_batch", "event_groups", "reconciled_hits", "replay_endpoint_for",
]
