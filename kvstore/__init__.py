"""kvstore: a tiered KV-cache store for LLM inference.

Embedded use::

    from kvstore import KVLayout, StoreConfig, TieredStore
    store = TieredStore(StoreConfig(layout=KVLayout(24, 2, 64), host_bytes=1 << 30))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.config import StoreConfig
from kvstore.errors import (
    CapacityError,
    ConfigError,
    CorruptSlotError,
    DaemonUnreachableError,
    KVStoreError,
    LayoutMismatchError,
    TierError,
    TierFullError,
    TierIOError,
)
from kvstore.index import PrefixMatch
from kvstore.keys import BlockHasher, Namespace
from kvstore.layout import KVLayout
from kvstore.store import TieredStore
from kvstore.transfer import FetchHandle, FetchResult

if TYPE_CHECKING:
    from kvstore.daemon.client import connect

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # kvstore.connect (the daemon's client) loads on first use: embedding needs none of it.
    if name == "connect":
        from kvstore.daemon.client import connect

        return connect
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")

__all__ = [
    "BlockHasher",
    "CapacityError",
    "ConfigError",
    "CorruptSlotError",
    "DaemonUnreachableError",
    "FetchHandle",
    "FetchResult",
    "KVLayout",
    "KVStoreError",
    "LayoutMismatchError",
    "Namespace",
    "PrefixMatch",
    "StoreConfig",
    "TierError",
    "TierFullError",
    "TierIOError",
    "TieredStore",
    "connect",
]
