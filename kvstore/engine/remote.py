"""DaemonStore: a kvstore daemon (``kvstore serve``) as the engine's host and disk tiers.

The engine calls a store the way it calls an embedded TieredStore: ``block_keys(tokens,
tenant, parent=)`` and ``put(keys, blocks, tenant=)``. A daemon connection has one tenant,
set by its token, and the daemon scopes every key it receives to that tenant. So two
isolations stack:

  token's tenant    the daemon's scoping: engines with different tokens share nothing
  request's tenant  the key salt, as embedded: requests of one engine with different
                    tenants share nothing, on the device or in the daemon; "" salts with
                    the token's tenant, as ``StoreClient.block_keys`` does

Engines that connect with the same token, model id and layout compute the same keys for
the same prompt and tenant, so they share each other's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvstore.index import PrefixMatch
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.transfer import FetchHandle


class DaemonStore:
    """The engine's store over a daemon client (one connection; the client serialises calls)."""

    def __init__(self, url: str, token: str | None, layout: KVLayout, model_id: str) -> None:
        from kvstore.client.client import connect

        self.client = connect(url, token, layout=layout, model_id=model_id)
        self.layout = layout
        self.url = url

    @property
    def tenant(self) -> str:
        """The daemon-side tenant of this connection's token."""
        return self.client.tenant

    @property
    def namespace(self) -> Namespace:
        return self.client.hasher.namespace

    def block_keys(self, token_ids: Sequence[int], tenant: str = "", extra_keys: Any = None,
                   parent: bytes | None = None) -> list[bytes]:
        return self.client.hasher.block_keys(token_ids, tenant or self.client.tenant, extra_keys, parent)

    def lookup(self, keys: Sequence[bytes]) -> PrefixMatch:
        return self.client.lookup(keys)

    def fetch(self, keys: Sequence[bytes], into: torch.Tensor) -> FetchHandle:
        return self.client.fetch(keys, into)

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor, *, tenant: str = "") -> None:
        # ``tenant`` already salted the keys; the daemon files them under the token's tenant.
        self.client.put(keys, blocks)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return self.client.contains(keys)

    def stats(self) -> dict[str, dict[str, int]]:
        return self.client.stats()

    def close(self) -> None:
        self.client.close()
