"""KV events: what each tier holds, as a ZeroMQ stream in vLLM's wire format (docs/kv-events.md).

Publish with ``EventPublisher(EventsConfig(endpoint))``; follow with ``Subscriber(endpoint,
replay_endpoint=...)``, whose ``sink`` (an ``EventView``) holds each medium's block set.
"""

from __future__ import annotations

from kvstore.events.config import EventsConfig, replay_endpoint_for
from kvstore.events.publisher import EventPublisher
from kvstore.events.sinks import CallbackSink, FanOut
from kvstore.events.subscriber import Subscriber
from kvstore.events.view import EventView
from kvstore.events.wire import (
    CPU,
    DISK,
    GPU,
    MEDIA,
    REMOTE,
    TIER_MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
    WireError,
    decode_batch,
    encode_batch,
)

__all__ = [
    "CPU", "DISK", "GPU", "MEDIA", "REMOTE", "TIER_MEDIA", "AllBlocksCleared", "BlockRemoved", "BlockStored",
    "CallbackSink", "EventBatch", "EventPublisher", "EventView", "EventsConfig", "FanOut", "Subscriber",
    "UnknownEvent", "WireError", "decode_batch", "encode_batch", "replay_endpoint_for",
]
