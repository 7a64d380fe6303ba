"""kvstore as vLLM's KV cache backend: ``kv_connector_module_path="kvstore.integrations.vllm"``.

``KVStoreConnector`` imports vLLM (``pip install 'kvstore[vllm]'``) when first named; the
settings, identity, store and copy modules import without it. See docs/vllm.md.
"""

from __future__ import annotations

from typing import Any

from kvstore.integrations.vllm.counters import COUNTERS, flush


def counters() -> dict[str, int]:
    """This process's connector counters (see ConnectorCounters), as a new dict."""
    return COUNTERS.snapshot()


def __getattr__(name: str) -> Any:
    if name == "KVStoreConnector":  # vLLM's loader: getattr(import_module(path), kv_connector)
        from kvstore.integrations.vllm.connector import KVStoreConnector

        return KVStoreConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KVStoreConnector", "counters", "flush"]
