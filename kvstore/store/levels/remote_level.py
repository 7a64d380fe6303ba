"""RemoteLevel: the shared remote tier (tiers.remote.RemoteTier, a Redis Cluster) as a level."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstore.results import REMOTE
from kvstore.store.levels.coding import LevelCodec
from kvstore.store.levels.shared import UNKNOWN_TENANT, SharedLevel, owner_tag
from kvstore.tiers.remote import RemoteTier

CLOSE_FLUSH_S = 5.0  # the most close() waits for queued blocks to reach the remote
MAX_KNOWN_TENANTS = 4096  # tenant names remembered per level to name the blocks it delivers


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
        self._tenants: dict[bytes, str] = {owner_tag(""): ""}  # owner tag -> tenant name, as met

    def know_tenant(self, tenant: str) -> None:
        tag = owner_tag(tenant)
        if tag not in self._tenants:
            with self._lock:
                if len(self._tenants) >= MAX_KNOWN_TENANTS:
                    self._tenants = {owner_tag(""): ""}
                self._tenants[tag] = tenant

    def tenant_of(self, tag: bytes | None) -> str | None:
        """The name of the tenant whose tag is ``tag`` (``#<hex>`` when none met here has it)."""
        if tag is None:
            return None
        return self._tenants.get(tag, UNKNOWN_TENANT + tag.hex())

    def _owners(self, tenants: Sequence[str] | None, n: int) -> list[bytes] | None:
        if tenants is None:
            return None
        for tenant in set(tenants):
            self.know_tenant(tenant)
        tags = {t: owner_tag(t) for t in set(tenants)}
        return [tags[t] for t in tenants[:n]]

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        return self.tier.contains(keys) if keys else []

    def forget_tenant(self, tenant: str) -> tuple[int, list[str]]:
        result = self.tier.forget_owner(owner_tag(tenant))
        return result.deleted, list(result.failed)

    def forget_hints(self) -> None:
        self.tier.forget_hints()

    def _count(self, found: int, asked: int) -> None:
        with self._lock:
            self.counters.hits += found
            self.counters.misses += 1 if found < asked else 0

    def leading(self, keys: Sequence[bytes]) -> int:
        n = self.tier.lookup(keys) if keys else 0
        self._count(n, len(keys))
        return n

    def read(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor],
             tenants: list[str | None] | None = None) -> list[bool]:
        if not keys:
            return []
        owners: list[bytes | None] | None = None if tenants is None else [None] * len(keys)
        if self.coding is None:
            flags = self.tier.get(keys, outs, leading=True, owners=owners)
        else:
            stored = torch.empty((len(keys), self.coding.stored_bytes), dtype=torch.uint8)
            flags = self.tier.get(keys, list(stored), leading=True, owners=owners)
            found = flags.index(False) if False in flags else len(flags)
            decoded = self.coding.decode(list(stored[:found]), outs[:found])
            refused = [keys[i] for i, ok in enumerate(decoded) if not ok]
            if refused:  # intact values no codec here reads: every reader would refuse them
                self.tier.counters.error("corrupt", len(refused), reason="codec")
                self.tier.delete(refused)
            flags = decoded + [False] * (len(keys) - found)
        self._count(flags.index(False) if False in flags else len(flags), len(keys))
        if tenants is not None and owners is not None:
            for i, good in enumerate(flags):
                tenants[i] = self.tenant_of(owners[i]) if good else None
        return flags

    def offer(self, keys: Sequence[bytes], payloads: Sequence[torch.Tensor],
              tenants: Sequence[str] | None = None) -> None:
        if not keys:
            return
        # Room first: blocks the queue cannot take are dropped before anything copies (or
        # encodes) them. A close() of a demoting store offers every host block at once.
        with self.tier.reserve(len(keys)) as room:
            owners = self._owners(tenants, room.size)
            keys, payloads = keys[: room.size], payloads[: room.size]
            if self.coding is not None and keys:
                keys, payloads, owners = self._encode(keys, payloads, owners)
            self.tier.put_into(room, keys, payloads, owners=owners)

    def _encode(self, keys: Sequence[bytes], payloads: Sequence[torch.Tensor], owners: list[bytes] | None,
                ) -> tuple[list[bytes], list[torch.Tensor], list[bytes] | None]:
        """The blocks the codec takes, encoded: one call for the lot, block by block only when
        it refused one. A refused block is left out (the room it leaves counts it as dropped)."""
        coding = self.coding
        assert coding is not None
        stored = list(torch.empty((len(keys), coding.stored_bytes), dtype=torch.uint8))
        try:
            coding.encode(payloads, stored)
        except Exception:  # NaN/Inf or a scale out of range in some block: keep the others
            kept = [i for i in range(len(keys)) if _encodes(coding, payloads[i], stored[i])]
            return ([keys[i] for i in kept], [stored[i] for i in kept],
                    None if owners is None else [owners[i] for i in kept])
        return list(keys), stored, owners

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
                                                "pending", "nodes_up", "round_trips", "hint_hits", "hint_misses",
                                                "kept_used", "replica_reads")})
        out.update(codec=self.coding.codec.name if self.coding else "none", lossy=self.lossy)
        return out

    def nodes(self) -> list[dict[str, Any]]:
        return [n.as_dict() for n in self.tier.nodes()]

    def close(self) -> None:
        self.tier.close(CLOSE_FLUSH_S)


def _encodes(coding: LevelCodec, payload: torch.Tensor, out: torch.Tensor) -> bool:
    try:
        coding.encode([payload], [out])
    except Exception:
        return False
    return True
