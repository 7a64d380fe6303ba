"""The daemon client's cache-management calls: prefetch, inspect, forget (docs/protocol.md).

``StoreClient`` holds one ``ManagementCalls`` over its channel and hands these calls to it.
Each acts on the connection's tenant, or with the admin token on the ``tenant`` named. Bad
input is a ValueError before anything is sent: more keys than one request may carry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.api import MAX_KEYS, check_count
from kvstore.client.channel import Channel
from kvstore.results import BlockInfo, ForgetReport, PrefetchHandle

FORGET_TIMEOUT_S = 600.0  # a forget sweeps the remote tier: it may take a while
STATUS_WAIT_S = 1.0  # the longest one prefetch_status request waits on the daemon


class ManagementCalls:
    """``prefetch``, ``inspect`` and ``forget_tenant`` as requests on one channel."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel

    def prefetch(self, keys: Sequence[bytes], *, tenant: str | None = None) -> PrefetchHandle:
        """Have the daemon bring the blocks up to its host RAM; returns at once. ``result()``
        asks the daemon (``prefetch_status``) until it is done. ``tenant``: another tenant's
        blocks (the admin token only)."""
        limit = min(MAX_KEYS, self._channel.max_keys)
        if len(keys) > limit:
            raise ValueError(f"a prefetch names at most {limit} keys, got {len(keys)}; split it")
        check_count("prefetch", len(keys))
        meta: dict[str, Any] = {"op": "prefetch", "keys": self._channel.keys_blob(keys)}
        if tenant is not None:
            meta["tenant"] = tenant
        reply = self._channel.call(meta)[0]
        prefetch_id = int(reply["prefetch"])

        def poll(wait_s: float) -> int | None:
            status = self._channel.call({"op": "prefetch_status", "prefetch": prefetch_id,
                                         "wait_s": min(max(wait_s, 0.0), STATUS_WAIT_S)})[0]
            return int(status["num_blocks"]) if status["done"] else None

        return PrefetchHandle(len(keys), poll)

    def inspect(self, keys: Sequence[bytes], *, tenant: str | None = None) -> list[BlockInfo | None]:
        """Per key: the tiers holding its block in the daemon, codecs, stored sizes, pins."""
        check_count("inspect", len(keys))
        out: list[BlockInfo | None] = []
        for batch in self._channel.key_batches(keys):
            meta: dict[str, Any] = {"op": "inspect", "keys": self._channel.keys_blob(batch)}
            if tenant is not None:
                meta["tenant"] = tenant
            for key, row in zip(batch, self._channel.call(meta)[0]["blocks"], strict=True):
                out.append(None if row is None else BlockInfo(
                    key, tuple(row["tiers"]), dict(row["codecs"]), dict(row["stored_bytes"]), row["tenant"],
                    int(row["pins"]), row["pin_expires_s"]))
        return out

    def forget_tenant(self, tenant: str | None = None, *, timeout: float = FORGET_TIMEOUT_S) -> ForgetReport:
        """Delete every block of a tenant from every tier of every namespace of the daemon:
        this connection's tenant (None), or with the admin token the one named. Waits up to
        ``timeout`` seconds for the daemon's answer."""
        meta: dict[str, Any] = {"op": "forget"}
        if tenant is not None:
            meta["tenant"] = tenant
        with self._channel.timeout(timeout):
            reply = self._channel.call(meta)[0]
        return ForgetReport(reply["tenant"], dict(reply["deleted"]), int(reply["num_blocks"]),
                            int(reply["pins_released"]), tuple(reply["failures"]))
