"""Per-tenant counters of one tier: what a tenant got from it and what it cost the others.

Kept by the tier's ``TenantPolicy`` (kvstore/policy/tenant_policy.py); read by
``TieredStore.view.tenant_stats()`` (kvstore/store/usage.py), the daemon's REST and /metrics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TenantCounters:
    """Monotonic counters of one tenant in one tier.

    ``hits``/``misses``: the tenant's blocks the tier served or lacked (counted as the tier's
    own, kvstore/store/lookup_counts.py); ``evictions_suffered``: the tenant's blocks
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
