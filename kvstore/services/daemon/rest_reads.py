"""REST's read routes (docs/rest.md): the dashboard, ``/healthz``, ``/metrics``, ``/v1/tiers``,
``/v1/stats``, ``/v1/lookup``, ``/v1/blocks/{key}``, ``/v1/namespaces``.

None changes the store. ``/``, ``/healthz``, ``/metrics`` and ``/v1/tiers`` need no token
(occupancy only, no tenant data: ``/metrics`` leaves the per-tenant series out unless a
token shows which it may see); the others are ``Reader`` routes, and a tenant token sees its
own tenant's counters and blocks only.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, Field

from kvstore.services.daemon.metrics import render
from kvstore.services.daemon.registry import COUNTERS, Registry
from kvstore.services.daemon.rest_common import HEX_KEY, Reader, TokenId, caller, sees_all
from kvstore.store.stats import is_count


class LookupRequest(BaseModel):
    model: str = Field(min_length=1, max_length=256, description="model id (or namespace id)")
    token_ids: list[TokenId] = Field(max_length=1 << 20)
    namespace: str | None = Field(None, max_length=64, description="needed when a model has several layouts")


def reads_router(registry: Registry, daemon: Any = None) -> APIRouter:
    """The read routes over ``registry``; ``daemon`` (optional) adds its connection, lease,
    request and error counts to ``/metrics`` and ``/v1/stats``."""
    router = APIRouter()
    dashboard = resources.files("kvstore.services.daemon").joinpath("static/dashboard.html").read_text()
    started = time.time()

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index() -> str:
        return dashboard

    @router.get("/healthz")
    def healthz() -> dict[str, Any]:
        """Liveness: 200 while the process serves."""
        return {"status": "ok", "uptime_s": round(time.time() - started, 3), "namespaces": len(registry.namespaces())}

    @router.get("/metrics", response_class=Response)
    def metrics(request: Request) -> Response:
        """Prometheus text format; per-tier series carry ``tier`` and ``namespace`` labels.

        With tokens configured, the per-tenant series are the caller's: every tenant's with
        the admin token, its own with a tenant token, none without a token (401 for an
        unknown one). An open store shows them all.
        """
        tenants: tuple[str, ...] | None = None
        if not registry.tokens.is_open:
            who = caller(request)
            tenants = () if who is None else None if who.admin else (who.tenant,)
        return Response(render(registry, daemon, tenants), media_type="text/plain; version=0.0.4")

    @router.get("/v1/tiers")
    def tiers() -> dict[str, Any]:
        """Per tier (summed over namespaces): capacity, occupancy and counters; with a remote
        tier also its nodes (address, up, breaker, used_memory, maxmemory, evicted_keys, keys)."""
        out: dict[str, Any] = {"time": time.time(), "tiers": registry.tiers()}
        nodes = registry.remote_nodes()
        if nodes:
            out["remote_nodes"] = nodes
        return out

    @router.get("/v1/stats")
    def stats(who: Reader) -> dict[str, Any]:
        """Totals, hit ratio per tier, counters per namespace and per tenant."""
        everyone = sees_all(registry, who)
        per_tier = registry.tiers()
        totals: dict[str, int] = {}
        for row in per_tier.values():
            for name, value in row.items():
                if is_count(value):
                    totals[name] = totals.get(name, 0) + value
        ratio = {t: (r["hits"] / (r["hits"] + r["misses"]) if r["hits"] + r["misses"] else None)
                 for t, r in per_tier.items()}
        tenants = registry.tenant_counters()
        if not everyone:
            tenants = {who.tenant: tenants.get(who.tenant, dict.fromkeys(COUNTERS, 0))}
        spaces = {}
        for state in registry.namespaces():
            rows = {t: c for t, c in list(state.counters.items()) if everyone or t == who.tenant}
            summed = dict.fromkeys(COUNTERS, 0)
            for row in rows.values():
                for name, value in row.items():
                    summed[name] = summed.get(name, 0) + value
            spaces[state.id] = {"model_id": state.model_id, "num_blocks": len(state.store),
                                "tiers": state.store.stats(), "counters": summed}
        out: dict[str, Any] = {"totals": totals, "hit_ratio": ratio, "tiers": per_tier,
                               "namespaces": spaces, "tenants": tenants}
        if daemon is not None:
            out["daemon"] = {"connections": daemon.num_connections, "inflight": daemon.num_inflight,
                             "leases": len(daemon.leases), "requests": dict(daemon.ops.requests),
                             "errors": dict(daemon.ops.errors)}
            if getattr(daemon, "kv_events", None) is not None:
                out["daemon"]["kv_events"] = daemon.kv_events.stats()
        return out

    @router.post("/v1/lookup")
    def lookup(body: LookupRequest, who: Reader) -> dict[str, Any]:
        """Matched tokens per tier for the caller's tenant (the token decides the tenant)."""
        found = [s for s in registry.find_model(body.model) if body.namespace in (None, s.id)]
        if not found:
            raise HTTPException(404, f"no namespace serves model {body.model!r}")
        if len(found) > 1:
            raise HTTPException(409, f"model {body.model!r} has {len(found)} namespaces "
                                f"({', '.join(s.id for s in found)}); name one in 'namespace'")
        state = found[0]
        keys = state.scope(who.tenant, state.store.block_keys(body.token_ids, tenant=who.tenant))
        match = state.store.lookup(keys) if keys else None
        bs = state.layout.block_size
        tiers = match.tiers if match else ()
        per_tier = {t: sum(1 for x in tiers if x == t) * bs for t in state.store.stats()}
        lossy = sum(match.lossy) * bs if match else 0  # held only as a lossy codec's copy
        return {"model": state.model_id, "namespace": state.id, "tenant": who.tenant,
                "num_tokens": len(body.token_ids), "num_blocks": len(tiers),
                "matched_tokens": {**per_tier, "total": len(tiers) * bs}, "lossy_tokens": lossy}

    @router.get("/v1/blocks/{key}")
    def block(key: Annotated[str, Path(pattern=HEX_KEY)], who: Reader) -> dict[str, Any]:
        """One block: tier(s), size, tenant, created, last access, pins."""
        raw = bytes.fromhex(key)
        everyone = sees_all(registry, who)
        for state in registry.namespaces():
            candidates = [state.scope(who.tenant, [raw])[0]] + ([raw] if everyone else [])
            for stored in candidates:
                if len(stored) != state.store.hasher.key_bytes:
                    continue
                info = state.store.view.block_info(stored)
                if info is not None and (everyone or info["tenant"] == who.tenant):
                    return {**info, "namespace": state.id, "model_id": state.model_id}
        raise HTTPException(404, f"no block {key}")

    @router.get("/v1/namespaces")
    def list_namespaces(who: Reader) -> dict[str, Any]:
        """Every namespace (model + KV layout) the store serves."""
        return {"namespaces": [s.describe() for s in registry.namespaces()]}

    return router
