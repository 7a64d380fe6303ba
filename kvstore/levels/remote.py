"""RemoteLevel: the shared remote tier (tiers.remote.RemoteTier, a Redis Cluster) as a level."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstore.index import REMOTE
from kvstore.levels.coding import LevelCodec
from kvstore.levels.shared import SharedLevel
from tiers.remote import RemoteTier

CLOSE_FLUSH_S = 5.0  # the most close() waits for queued blocks to reach the remote


class RemoteLevel(SharedLevel):
    """Blocks in a Redis Cluster that every store of the deployment shares (docs/remote.md).

    Names are per block (G = 1): a block is named from its own key alone, so a writer needs
    neither its depth in the chain nor its group head's key, and a tail run demoted mid-chain
    is named the same way a reader names it.

    With a codec the values hold encoded blocks (the tier's layout id names the codec too, so
    a store reading with another codec misses them instead of misreading them).
    """

    def __init__(self, tier: RemoteTier, source: str, coding: LevelCodec | None = None) -> None:
        super().__init__(REMOTE, source, coding)
        self.tier = tier
        self._lock = threading.Lock()  # callers come without the store lock

    def _count(self, found: int, asked: int) -> None:
        with self._lock:
            self.counters.hits += found
            self.counters.misses += 1 if found < asked else 0

    def leading(self, keys: Sequence[bytes]) -> int:
        n = self.tier.exists(keys) if keys else 0
        self._count(n, len(keys))
        return n

    def read(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> list[bool]:
        if not keys:
            return []
        if self.coding is None:
            flags = self.tier.get(keys, outs)
        else:
            stored = torch.empty((len(keys), self.coding.stored_bytes), dtype=torch.uint8)
            flags = self.tier.get(keys, list(stored))
            found = flags.index(False) if False in flags else len(flags)
            decoded = self.coding.decode(list(stored[:found]), outs[:found])
            flags = decoded + [False] * (len(keys) - found)
        self._count(flags.index(False) if False in flags else len(flags), len(keys))
        return flags

    def offer(self, keys: Sequence[bytes], payloads: Sequence[torch.Tensor]) -> None:
        if not keys:
            return
        if self.coding is not None:
            stored = torch.empty((len(keys), self.coding.stored_bytes), dtype=torch.uint8)
            try:
                self.coding.encode(payloads, list(stored))
            except Exception:  # a block the codec refuses is not sent; counted as dropped
                self.tier.counters.add(dropped=len(keys))
                return
            payloads = list(stored)
        self.tier.put_async(keys, payloads)

    def watch(self, stored: Callable[[list[bytes]], None]) -> None:
        self.tier.on_stored = stored

    def flush(self, timeout: float | None = None) -> bool:
        return self.tier.flush(timeout)

    def discard(self, keys: Sequence[bytes]) -> None:
        if keys:
            self.tier.delete(keys)

    def stats(self) -> dict[str, Any]:
        s = self.tier.stats()
        out: dict[str, Any] = {name: s[name] for name in ("capacity_bytes", "used_bytes", "num_blocks")}
        with self._lock:
            out.update(self.counters.as_dict())
        out.update({name: s[name] for name in ("evictions", "bytes_read", "bytes_written", "errors", "dropped",
                                                "pending", "nodes_up")})
        out.update(codec=self.coding.codec.name if self.coding else "none", lossy=self.lossy)
        return out

    def nodes(self) -> list[dict[str, Any]]:
        return [n.as_dict() for n in self.tier.nodes()]

    def close(self) -> None:
        self.tier.close(CLOSE_FLUSH_S)
