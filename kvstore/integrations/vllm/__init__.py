"""kvstore as vLLM's KV cache backend: ``kv_connector_module_path="kvstore.integrations.vllm"``.

Importing this package imports vLLM (``pip install 'kvstore[vllm]'``); see docs/vllm.md.
"""

from __future__ import annotations

from kvstore.integrations.vllm.connector import KVStoreConnector
from kvstore.integrations.vllm.counters import COUNTERS


def counters() -> dict[str, int]:
    """This process's connector counters (see ConnectorCounters), as a new dict."""
    return COUNTERS.snapshot()


__all__ = ["KVStoreConnector", "counters"]
