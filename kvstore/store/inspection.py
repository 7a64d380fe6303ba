"""StoreView (``TieredStore.view``): read-only views of a store's cascade, what REST, metrics,
KV-event snapshots and tests inspect.

Every method takes the store lock for its snapshot; none changes recency or placement.
"""

from __future__ import annotations

from typing import Any

from kvstore.store.cascade import Cascade
from kvstore.store.usage import index_usage, tenant_usage


class StoreView:
    def __init__(self, cascade: Cascade, payload_bytes: int) -> None:
        self.cascade = cascade
        self.payload_bytes = payload_bytes

    def held_by_tier(self) -> dict[str, list[tuple[bytes, bytes | None, int | None]]]:
        """Per tier name, ``(key, parent, group)`` of every block that tier holds (group: the KV
        group its put named, None where the store does not know it)."""
        cascade = self.cascade
        with cascade.lock:
            held: dict[str, list[tuple[bytes, bytes | None, int | None]]] = {
                level.name: [] for level in cascade.levels}
            names = cascade.index.level_names
            for entry in cascade.index.entries.values():
                for rank, slot in enumerate(entry.slots):
                    if slot is not None:
                        held[names[rank]].append((entry.key, entry.parent, entry.group))
            return held

    def held_keys(self, tenant: str | None = None) -> list[bytes]:
        """The keys the store holds (only ``tenant``'s when given)."""
        entries = self.cascade.index.entries
        with self.cascade.lock:
            if tenant is None:
                return list(entries)
            return [k for k, e in entries.items() if e.tenant == tenant]

    def block_info(self, key: bytes) -> dict[str, Any] | None:
        """One block's tiers (and its slot and codec in each), whether its best copy is lossy,
        the fastest tier holding the exact bytes, size, tenant, created/last access times and
        pins; None if absent."""
        cascade = self.cascade
        with cascade.lock:
            cascade.inflight.wait_written([key])
            entry = cascade.index.get(key)
            if entry is None:
                return None
            names = cascade.index.level_names
            tiers = [names[rank] for rank, slot in enumerate(entry.slots) if slot is not None]
            slots = {names[rank]: slot for rank, slot in enumerate(entry.slots) if slot is not None}
            codecs = {names[rank]: cascade.levels[rank].describe_codec()["codec"]
                      for rank, slot in enumerate(entry.slots) if slot is not None}
            return {
                "key": key.hex(), "tier": tiers[0] if tiers else None, "tiers": tiers, "slots": slots,
                "codecs": codecs, "lossy": entry.best_rank is not None and not entry.is_exact(entry.best_rank),
                "exact_tier": names[entry.exact_rank] if entry.exact_rank is not None else None,
                "size": self.payload_bytes,
                "tenant": entry.tenant, "created": entry.created,
                "last_access": entry.last_access or entry.created, "pins": entry.pins,
            }

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier: capacity_bytes, used_bytes, num_blocks, hits, misses, evictions,
        bytes_read, bytes_written, errors, refused (blocks in a format this reader refuses:
        misses), and the tier's ``codec`` (name) and ``lossy`` (bool). Bytes count what the
        tier stores (the encoded size under a codec). Host slots reserved for a promotion or
        a shared-memory writer count in ``used_bytes`` (they are taken) but hold no block yet,
        so not in ``num_blocks``. The remote tier adds dropped (writes given up), pending
        (queued writes) and nodes_up; its occupancy is the cluster's own (Redis INFO)."""
        cascade = self.cascade
        with cascade.lock:
            cascade.lookups.settle()  # lookups made while another thread held the lock
            out = {level.name: {**level.stats(), "codec": level.describe_codec()["codec"], "lossy": level.lossy}
                   for level in cascade.levels}
            out[cascade.host.name]["num_blocks"] -= cascade.reservations.num_reserved
        for shared in cascade.shared:  # outside the lock: this may ask the network
            out[shared.name] = shared.stats()
        return out

    def codecs(self) -> dict[str, dict[str, Any]]:
        """Per tier: ``{"codec", "lossy", "block_bytes", ...}``, how it represents blocks."""
        found = {level.name: level.describe_codec() for level in self.cascade.levels}
        for shared in self.cascade.shared:
            found[shared.name] = (shared.coding.describe() if shared.coding is not None else
                                  {"codec": "none", "lossy": False, "block_bytes": self.payload_bytes})
        return found

    def remote_nodes(self) -> list[dict[str, Any]]:
        """Per node of the shared levels: address, up, breaker, used_memory, maxmemory,
        evicted_keys, keys."""
        return [dict(node, tier=level.name) for level in self.cascade.shared for node in level.nodes()]

    def tenant_stats(self) -> dict[str, dict[str, Any]]:
        """Per tenant: per tier its blocks and bytes held, hits, misses, evictions caused and
        suffered, puts refused at its hard quota, and its quotas in blocks
        (kvstore/store/usage.py). ``stats()`` stays per tier: every caller reads its keys as
        tier names."""
        return tenant_usage(self.cascade)

    def index_usage(self) -> dict[str, dict[str, int]]:
        """Blocks per tenant and tier counted from the block index (a check of ``tenant_stats``)."""
        return index_usage(self.cascade)
