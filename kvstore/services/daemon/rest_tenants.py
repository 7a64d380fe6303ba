"""REST's tenant routes: usage and quotas per tenant (docs/rest.md, "Tenants: usage and quotas").

- ``GET /v1/tenants``: per tenant its request counters (the block protocol's), what it holds
  per tier and what that cost (usage: kvstore/store/usage.py), and its quotas
  (kvstore/policy/quotas.py). The admin token (or an open store) sees every tenant; a tenant
  token its own.
- ``GET /v1/quotas``: the quotas in force, the same visibility.
- ``PUT /v1/admin/quotas/{tenant}``: replace a tenant's quotas per tier at run time, in every
  namespace, no restart (admin only). 404 an unknown tenant; 422 a bad value (negative, a
  share past 1 or not above 0, an unknown tier, a hard quota off host RAM): nothing changes.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

from kvstore.errors import ConfigError
from kvstore.policy.quotas import TierQuota, parse_tiers
from kvstore.services.common.sizes import parse_size
from kvstore.services.common.tokens import Principal
from kvstore.services.daemon.registry import COUNTERS, Registry
from kvstore.services.daemon.rest_common import Admin, Reader, sees_all

LimitValue = StrictInt | StrictFloat | StrictStr


class LimitsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    soft: LimitValue | None = Field(None, description="bytes (int or \"2GiB\"), a share (0.25 or \"25%\")")
    hard: LimitValue | None = Field(None, description="as soft; host RAM only; at least soft")


class QuotaRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tiers: dict[str, LimitsBody | None] = Field(
        max_length=16, description='per tier ("host", "disk", or "*" for every tier): its limits; '
        "{} for none there, null to drop the tier's entry (the \"*\" one applies again)")


def tenants_view(registry: Registry, who: Principal) -> dict[str, Any]:
    """``{"tenants": counters, "usage": usage, "quotas": quotas}``, each by tenant: every
    tenant's for the admin, the caller's own for a tenant token (zeros before any traffic)."""
    counters = registry.tenant_counters()
    usage = registry.tenant_usage()
    table = registry.quota_table
    if not sees_all(registry, who):
        mine = who.tenant
        counters = {mine: counters.get(mine, dict.fromkeys(COUNTERS, 0))}
        usage = {mine: usage.get(mine, {"tiers": {}, "blocks": 0, "bytes": 0})}
        quotas = {mine: _quotas_of(registry, mine)}
    else:
        quotas = {t: _quotas_of(registry, t) for t in table.tenants}
    for tenant, row in usage.items():
        hits = sum(r.get("hits") or 0 for r in row["tiers"].values())
        asked = counters.get(tenant, {}).get("lookup_blocks", 0)
        found = counters.get(tenant, {}).get("hit_blocks", 0)
        row["hit_ratio"] = found / asked if asked else None  # the block protocol's, exact per tenant
        row["store_hits"] = hits
    return {"tenants": counters, "usage": usage, "quotas": quotas}


def _quotas_of(registry: Registry, tenant: str) -> dict[str, Any]:
    return {tier: q.as_dict() for tier, q in registry.quota_table.tenants.get(tenant, {}).items()}


def tenants_router(registry: Registry) -> APIRouter:
    """``/v1/tenants``, ``/v1/quotas`` and ``/v1/admin/quotas/{tenant}`` over ``registry``."""
    router = APIRouter()

    @router.get("/v1/tenants")
    def list_tenants(who: Reader) -> dict[str, Any]:
        """Per tenant: request counters, usage per tier, quotas (a tenant token sees its own only)."""
        return tenants_view(registry, who)

    @router.get("/v1/quotas")
    def quotas(who: Reader) -> dict[str, Any]:
        """The quotas in force by tenant and tier (a tenant token: its own)."""
        if sees_all(registry, who):
            return {"quotas": registry.quota_table.as_dict()}
        return {"quotas": {who.tenant: _quotas_of(registry, who.tenant)}}

    @router.put("/v1/admin/quotas/{tenant}")
    def set_quota(tenant: Annotated[str, Path(min_length=1, max_length=255)], body: QuotaRequest,
                  who: Admin) -> dict[str, Any]:
        """Replace ``tenant``'s quotas in the tiers named, now, in every namespace."""
        known = registry.quota_tenants()
        if known is not None and tenant not in known:
            raise HTTPException(404, f"no tenant {tenant[:80]!r}; the tokens name {sorted(t for t in known if t)}")
        try:
            given = {tier: limits.model_dump(exclude_none=True) for tier, limits in body.tiers.items()
                     if limits is not None}
            parsed: dict[str, TierQuota | None] = dict(parse_tiers(given, parse_size, f"quota of {tenant}"))
            parsed.update({tier: None for tier, limits in body.tiers.items() if limits is None})
            registry.set_quota(tenant, parsed)
        except ConfigError as exc:
            raise HTTPException(422, str(exc)) from None
        return {"tenant": tenant, "quotas": _quotas_of(registry, tenant),
                "usage": registry.tenant_usage().get(tenant, {"tiers": {}, "blocks": 0, "bytes": 0})}

    return router
