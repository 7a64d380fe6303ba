"""Usage per tenant: what each tenant holds in each tier, what it got, what it cost others.

Read from the tiers' ``TenantPolicy`` objects (kvstore/policy/tenant_policy.py), which know every
block's tenant, and the quotas in force (kvstore/policy/quotas.py). ``TieredStore.view.tenant_stats()``
returns it; the daemon's REST ``/v1/tenants``, ``/metrics`` and dashboard show it.

Per tenant and indexed tier:

- ``blocks``, ``bytes``: held now (bytes of the tier's slots: encoded under a codec). These
  are the policy's own count, which ``check_integrity`` holds equal to the block index's.
- ``hits``, ``misses``: as the tier's own counters, for lookups the store can name a tenant
  for (``Cascade.chain_tenant``: a chain whose first block it holds or once held).
- ``evictions_suffered``: its blocks evicted from the tier; ``evictions_caused``: evictions
  whose room its blocks took.
- ``refused``: blocks of its puts refused at its hard quota (host RAM).
- ``soft_blocks``, ``hard_blocks``: its quotas there in blocks (None: no such quota).
"""

from __future__ import annotations

from typing import Any

from kvstore.policy.tenant_counters import TenantCounters
from kvstore.store.cascade import Cascade


def tenant_usage(cascade: Cascade) -> dict[str, dict[str, Any]]:
    """Per tenant: ``{"tiers": {tier: row}, "blocks": n, "bytes": n}`` (see the module
    docstring), for every tenant that holds a block, has a counter or has a quota."""
    out: dict[str, dict[str, Any]] = {}
    with cascade.lock:
        cascade.lookups.settle()  # lookups made while another thread held the lock
        quoted = set(cascade.quota.table.tenants)
        for level in cascade.levels:
            policy = level.tenant_policy()
            if policy is None:
                continue
            tenants = set(policy.counts) | set(policy.counters.rows) | quoted
            for tenant in tenants:
                blocks = policy.counts.get(tenant, 0)
                counters = policy.counters.rows.get(tenant, TenantCounters())
                soft = policy.soft.get(tenant) if policy.partitioned else None
                row = {"blocks": blocks, "bytes": blocks * level.slot_bytes, **counters.as_dict(),
                       "soft_blocks": soft, "hard_blocks": policy.hard.get(tenant)}
                entry = out.setdefault(tenant, {"tiers": {}, "blocks": 0, "bytes": 0})
                entry["tiers"][level.name] = row
                entry["blocks"] += blocks
                entry["bytes"] += row["bytes"]
    return out


def index_usage(cascade: Cascade) -> dict[str, dict[str, int]]:
    """Blocks per tenant and tier counted from the block index itself (a check of
    ``tenant_usage``: tests compare the two after a storm)."""
    out: dict[str, dict[str, int]] = {}
    names = cascade.index.level_names
    with cascade.lock:
        cascade.inflight.wait_all_written()
        for entry in cascade.index.entries.values():
            for rank, slot in enumerate(entry.slots):
                if slot is not None:
                    row = out.setdefault(entry.tenant, {})
                    row[names[rank]] = row.get(names[rank], 0) + 1
    return out
