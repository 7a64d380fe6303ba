"""The REST app (FastAPI factory) over a daemon's registry or one embedded TieredStore.

Reads are open on an open daemon (no tokens configured); with tokens they need one, except
``/``, ``/healthz``, ``/metrics`` and ``/v1/tiers`` (occupancy only, no tenant data: ``/metrics``
leaves the per-tenant series out unless a token shows which it may see). A tenant token sees
its own tenant only. ``/v1/admin/*`` needs the admin token: 401 without a valid
token, 403 with a tenant token. Every endpoint is in docs/rest.md.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Path, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, Field

from kvstore.errors import CapacityError
from kvstore.services.common.tokens import AuthError, Principal, Tokens
from kvstore.services.daemon.metrics import render
from kvstore.services.daemon.registry import COUNTERS, NamespaceState, Registry
from kvstore.store import TieredStore
from kvstore.store.stats import is_count

TokenId = Annotated[int, Field(ge=0, lt=1 << 32)]
HexKey = Annotated[str, Field(pattern=r"^[0-9a-fA-F]{32}([0-9a-fA-F]{32})?$")]


class LookupRequest(BaseModel):
    model: str = Field(min_length=1, max_length=256, description="model id (or namespace id)")
    token_ids: list[TokenId] = Field(max_length=1 << 20)
    namespace: str | None = Field(None, max_length=64, description="needed when a model has several layouts")


class KeysRequest(BaseModel):
    keys: list[HexKey] = Field(min_length=1, max_length=1 << 16, description="block keys, hex")
    namespace: str | None = Field(None, max_length=64)
    tenant: str | None = Field(None, max_length=256, description="scope the keys as this tenant's client keys")
    unpin: bool = False


class FlushRequest(BaseModel):
    namespace: str | None = Field(None, max_length=64)
    tenant: str | None = Field(None, max_length=256)


# Dependencies live at module level: FastAPI resolves these (string) annotations in this
# module's globals. The app's registry is in ``request.app.state.registry``.


def caller(request: Request) -> Principal | None:
    header = request.headers.get("authorization", "")
    token = header[7:].strip() if header.lower().startswith("bearer ") else None
    if not token:
        return None
    try:
        return request.app.state.registry.tokens.authenticate(token)
    except AuthError:
        raise HTTPException(401, "unknown token") from None


def reader(request: Request, who: Annotated[Principal | None, Depends(caller)]) -> Principal:
    if who is None:
        if not request.app.state.registry.tokens.is_open:
            raise HTTPException(401, "a token is required (Authorization: Bearer TOKEN)")
        return Principal("", admin=False)
    return who


def admin(who: Annotated[Principal | None, Depends(caller)]) -> Principal:
    if who is None:
        raise HTTPException(401, "the admin token is required (Authorization: Bearer TOKEN)")
    if not who.admin:
        raise HTTPException(403, "this token is a tenant token; admin actions need the admin token")
    return who


Reader = Annotated[Principal, Depends(reader)]
Admin = Annotated[Principal, Depends(admin)]


def create_app(target: Registry | TieredStore, admin_token: str | None = None, daemon: Any = None,
               tokens: Tokens | None = None) -> FastAPI:
    """The REST app over a daemon's registry, or over one embedded store.

    Args:
        target: a daemon Registry, or a TieredStore (its keys are used unscoped).
        admin_token: the token /v1/admin/* needs (embedded use; a daemon's registry knows it).
        daemon: the Daemon, for its connection and request counters (optional).
        tokens: tenant tokens for an embedded store (default: open, tenant "").
    """
    registry = Registry.embedded(target, tokens or Tokens(admin_token, None)) if isinstance(target, TieredStore) else target
    app = FastAPI(title="kvstore", version="1", description="Tiers, hit rates, lookups and admin of a kvstore.")
    dashboard = resources.files("kvstore.services.daemon").joinpath("static/dashboard.html").read_text()
    started = time.time()
    app.state.registry = registry

    def sees_all(who: Principal) -> bool:
        return who.admin or registry.tokens.is_open

    def namespaces(ns_id: str | None) -> list[NamespaceState]:
        if ns_id is None:
            return registry.namespaces()
        state = registry.get(ns_id)
        if state is None:
            raise HTTPException(404, f"no namespace {ns_id!r}")
        return [state]

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index() -> str:
        return dashboard

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        """Liveness: 200 while the process serves."""
        return {"status": "ok", "uptime_s": round(time.time() - started, 3), "namespaces": len(registry.namespaces())}

    @app.get("/metrics", response_class=Response)
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

    @app.get("/v1/tiers")
    def tiers() -> dict[str, Any]:
        """Per tier (summed over namespaces): capacity, occupancy and counters; with a remote
        tier also its nodes (address, up, breaker, used_memory, maxmemory, evicted_keys, keys)."""
        out: dict[str, Any] = {"time": time.time(), "tiers": registry.tiers()}
        nodes = registry.remote_nodes()
        if nodes:
            out["remote_nodes"] = nodes
        return out

    @app.get("/v1/stats")
    def stats(who: Reader) -> dict[str, Any]:
        """Totals, hit ratio per tier, counters per namespace and per tenant."""
        per_tier = registry.tiers()
        totals: dict[str, int] = {}
        for row in per_tier.values():
            for name, value in row.items():
                if is_count(value):
                    totals[name] = totals.get(name, 0) + value
        ratio = {t: (r["hits"] / (r["hits"] + r["misses"]) if r["hits"] + r["misses"] else None)
                 for t, r in per_tier.items()}
        tenants = registry.tenant_counters()
        if not sees_all(who):
            tenants = {who.tenant: tenants.get(who.tenant, dict.fromkeys(COUNTERS, 0))}
        spaces = {}
        for state in registry.namespaces():
            rows = {t: c for t, c in list(state.counters.items()) if sees_all(who) or t == who.tenant}
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

    @app.post("/v1/lookup")
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

    @app.get("/v1/blocks/{key}")
    def block(key: Annotated[str, Path(pattern=r"^[0-9a-fA-F]{32}([0-9a-fA-F]{32})?$")],
              who: Reader) -> dict[str, Any]:
        """One block: tier(s), size, tenant, created, last access, pins."""
        raw = bytes.fromhex(key)
        for state in registry.namespaces():
            candidates = [state.scope(who.tenant, [raw])[0]] + ([raw] if sees_all(who) else [])
            for stored in candidates:
                if len(stored) != state.store.hasher.key_bytes:
                    continue
                info = state.store.block_info(stored)
                if info is not None and (sees_all(who) or info["tenant"] == who.tenant):
                    return {**info, "namespace": state.id, "model_id": state.model_id}
        raise HTTPException(404, f"no block {key}")

    @app.get("/v1/namespaces")
    def list_namespaces(who: Reader) -> dict[str, Any]:
        """Every namespace (model + KV layout) the store serves."""
        return {"namespaces": [s.describe() for s in registry.namespaces()]}

    @app.get("/v1/tenants")
    def list_tenants(who: Reader) -> dict[str, Any]:
        """Per tenant: request counters, usage per tier, quotas (a tenant token sees its own only)."""
        from kvstore.services.daemon.rest_tenants import tenants_view

        return tenants_view(registry, who)

    def stored_keys(body: KeysRequest) -> list[tuple[NamespaceState, list[bytes]]]:
        out = []
        for state in namespaces(body.namespace):
            raw = [bytes.fromhex(k) for k in body.keys]
            raw = [k for k in raw if len(k) == state.store.hasher.key_bytes]
            out.append((state, state.scope(body.tenant, raw) if body.tenant is not None else raw))
        return out

    @app.post("/v1/admin/flush")
    def flush(body: FlushRequest, who: Admin) -> dict[str, Any]:
        """Delete every block not pinned or being read (of one namespace / tenant if named)."""
        deleted = skipped = 0
        for state in namespaces(body.namespace):
            for key in state.store.held_keys(body.tenant):
                try:
                    deleted += state.store.delete([key])
                except CapacityError:
                    skipped += 1
        return {"deleted": deleted, "skipped": skipped}

    @app.post("/v1/admin/pin")
    def pin(body: KeysRequest, who: Admin) -> dict[str, Any]:
        """Pin (or with ``unpin: true`` unpin) blocks by stored key, or by a tenant's client keys."""
        done = 0
        for state, keys in stored_keys(body):
            held = [k for k, ok in zip(keys, state.store.contains(keys), strict=True) if ok]
            try:
                (state.store.unpin if body.unpin else state.store.pin)(held)
            except (KeyError, ValueError) as exc:
                raise HTTPException(409, str(exc)) from None
            done += len(held)
        if not done:
            raise HTTPException(404, "none of these blocks is in the store")
        return {"unpinned" if body.unpin else "pinned": done}

    @app.post("/v1/admin/evict")
    def evict(body: KeysRequest, who: Admin) -> dict[str, Any]:
        """Remove blocks from every tier (409 if one is pinned or being read)."""
        evicted = 0
        for state, keys in stored_keys(body):
            try:
                evicted += state.store.delete(keys)
            except CapacityError as exc:
                raise HTTPException(409, str(exc)) from None
        return {"evicted": evicted}

    from kvstore.services.daemon.rest_cache import add_cache_routes  # it imports this module's dependencies

    add_cache_routes(app)
    from kvstore.services.daemon.rest_tenants import add_tenant_routes

    add_tenant_routes(app)
    return app
