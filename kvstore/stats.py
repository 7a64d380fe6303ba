"""Per-tier counters, as reported by ``TieredStore.stats()`` (and through it the daemon's REST and /metrics)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class TierCounters:
    """Monotonic counters of one tier. ``hits``/``misses`` count blocks asked of this tier."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    refused: int = 0  # blocks whose encoding (another codec's format version) this reader refuses

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def tier_stats(
    counters: TierCounters, capacity_bytes: int, num_blocks: int, slot_bytes: int, extra_errors: int = 0
) -> dict[str, int]:
    """One tier's entry of ``stats()``: occupancy plus counters."""
    out = {
        "capacity_bytes": capacity_bytes,
        "used_bytes": num_blocks * slot_bytes,
        "num_blocks": num_blocks,
    }
    out.update(counters.as_dict())
    out["errors"] += extra_errors
    return out


def is_count(value: Any) -> bool:
    """Whether a ``stats()`` value is a number to sum (not the tier's codec name or lossy flag)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class TenantCounters:
    """Monotonic counters of one tenant in one tier.

    ``hits``/``misses``: the tenant's blocks the tier served or lacked (counted as the tier's
    own, kvstore.cascade's ``count_lookup``); ``evictions_suffered``: the tenant's blocks
    evicted from the tier; ``evictions_caused``: evictions whose room the tenant's blocks took;
    ``refused``: blocks of its puts refused at its hard quota.
    """

    hits: int = 0
    misses: int = 0
    evictions_caused: int = 0
    evictions_suffered: int = 0
    refused: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


OTHER_TENANTS = "(other)"  # the row of tenants past MAX_TENANT_ROWS
MAX_TENANT_ROWS = 1024


class TenantTable:
    """``TenantCounters`` per tenant of one tier, at most ``MAX_TENANT_ROWS`` rows: tenants
    first seen past that share the row ``OTHER_TENANTS`` (an embedded store takes any tenant
    string, and counters must not grow without bound)."""

    def __init__(self) -> None:
        self.rows: dict[str, TenantCounters] = {}

    def row(self, tenant: str) -> TenantCounters:
        found = self.rows.get(tenant)
        if found is None:
            if len(self.rows) >= MAX_TENANT_ROWS:
                tenant = OTHER_TENANTS
            found = self.rows.setdefault(tenant, TenantCounters())
        return found
