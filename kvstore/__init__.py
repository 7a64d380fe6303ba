"""kvstore: a tiered KV-cache store for LLM inference.

Embedded use::

    from kvstore import KVLayout, StoreConfig, TieredStore
    store = TieredStore(StoreConfig(layout=KVLayout(24, 2, 64), host_bytes=1 << 30))

The names below load on first use, so that importing one part (``kvstore.kernels``, say)
loads that part alone, not the whole store.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.api import BlockStore
    from kvstore.client.client import StoreClient, connect
    from kvstore.config import StoreConfig, StoreSettings
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
    from kvstore.keys import BlockHasher, Namespace
    from kvstore.layout import KVLayout
    from kvstore.results import FetchHandle, FetchResult, PrefixMatch
    from kvstore.store import TieredStore

__version__ = "0.1.0"

_EXPORTS = {
    "BlockStore": "kvstore.api",
    "StoreClient": "kvstore.client.client",
    "connect": "kvstore.client.client",
    "StoreConfig": "kvstore.config",
    "StoreSettings": "kvstore.config",
    "CapacityError": "kvstore.errors",
    "ConfigError": "kvstore.errors",
    "CorruptSlotError": "kvstore.errors",
    "DaemonUnreachableError": "kvstore.errors",
    "KVStoreError": "kvstore.errors",
    "LayoutMismatchError": "kvstore.errors",
    "TierError": "kvstore.errors",
    "TierFullError": "kvstore.errors",
    "TierIOError": "kvstore.errors",
    "PrefixMatch": "kvstore.results",
    "BlockHasher": "kvstore.keys",
    "Namespace": "kvstore.keys",
    "KVLayout": "kvstore.layout",
    "TieredStore": "kvstore.store",
    "FetchHandle": "kvstore.results",
    "FetchResult": "kvstore.results",
}


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "BlockHasher",
    "BlockStore",
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
    "StoreClient",
    "StoreConfig",
    "StoreSettings",
    "TierError",
    "TierFullError",
    "TierIOError",
    "TieredStore",
    "connect",
]
