"""REST's cache-management routes, ``/v1/cache/*`` (docs/rest.md, "Managing the cache").

Every route acts on the caller's tenant (its token's; an open daemon's is ``""``); the admin
token may name another with ``tenant`` (kvstore/services/daemon/tenant_admin.py). Blocks are
named by ``token_ids`` (the tenant's chain of that prompt) or by ``keys`` (the tenant's block
keys, hex, as its client computes them); the daemon scopes them as the tenant's, as it does
every key a connection sends. A pin over REST has no connection to end with it, so it needs
a ``ttl_s``. Errors: 400 bad input (a bound named), 401/403 tokens, 404 unknown tenant,
namespace or prefetch, 409 a block pinned or being read, 429 too many prefetches pending.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Path
from pydantic import BaseModel, Field, model_validator

from kvstore.api import MAX_KEYS, MAX_PIN_TTL_S
from kvstore.errors import CapacityError, KVStoreError
from kvstore.results import PrefetchHandle
from kvstore.services.common.tokens import Principal
from kvstore.services.daemon.registry import NamespaceState
from kvstore.services.daemon.rest import HexKey, Reader, TokenId
from kvstore.services.daemon.tenant_admin import NotAllowed, UnknownTenant, acting_tenant, forget_everywhere

REST_HOLDER = -1  # the holder of pins taken over REST: /v1/cache/unpin undoes only these
MAX_PREFETCHES = 1024  # prefetches the app remembers (done ones go first)


class BlocksRequest(BaseModel):
    model: str = Field(min_length=1, max_length=256, description="model id (or namespace id)")
    namespace: str | None = Field(None, max_length=64, description="needed when a model has several layouts")
    token_ids: list[TokenId] | None = Field(None, max_length=1 << 20, description="a prompt: its chain's blocks")
    keys: list[HexKey] | None = Field(None, max_length=MAX_KEYS, description="the tenant's block keys, hex")
    tenant: str | None = Field(None, max_length=256, description="another tenant's blocks (admin token only)")

    @model_validator(mode="after")
    def _one_of(self) -> BlocksRequest:
        if (self.token_ids is None) == (self.keys is None):
            raise ValueError("give exactly one of token_ids or keys")
        return self


class PinRequest(BlocksRequest):
    ttl_s: float = Field(gt=0, le=MAX_PIN_TTL_S, description="seconds the pins last at most (required)")


class DeleteRequest(BlocksRequest):
    descendants: bool = Field(False, description="also every block chained below them")


class ForgetRequest(BaseModel):
    tenant: str = Field(max_length=256, description="the tenant to forget (a tenant token: its own)")


def add_cache_routes(app: FastAPI) -> None:
    """Register ``/v1/cache/*`` on the REST app (its registry in ``app.state.registry``)."""
    registry = app.state.registry
    prefetches: OrderedDict[str, tuple[str, PrefetchHandle]] = OrderedDict()
    prefetches_lock = threading.Lock()  # the routes run on a thread pool

    def tenant_of(who: Principal, asked: str | None) -> str:
        try:
            return acting_tenant(registry, who, asked)
        except NotAllowed as exc:
            raise HTTPException(403, str(exc)) from None
        except UnknownTenant as exc:
            raise HTTPException(404, str(exc)) from None

    def blocks(body: BlocksRequest, who: Principal) -> tuple[NamespaceState, str, list[bytes], list[bytes]]:
        """The namespace, the acting tenant, the client keys and the keys as filed."""
        tenant = tenant_of(who, body.tenant)
        found = [s for s in registry.find_model(body.model) if body.namespace in (None, s.id)]
        if not found:
            raise HTTPException(404, f"no namespace serves model {body.model!r}")
        if len(found) > 1:
            raise HTTPException(409, f"model {body.model!r} has {len(found)} namespaces; name one in 'namespace'")
        state = found[0]
        if body.keys is not None:
            raw = [bytes.fromhex(k) for k in body.keys]
            width = state.store.hasher.key_bytes
            wrong = [k for k in raw if len(k) != width]
            if wrong:
                raise HTTPException(400, f"keys of this namespace are {width} bytes ({2 * width} hex digits); "
                                    f"{len(wrong)} are not, first {wrong[0].hex()}")
        else:
            assert body.token_ids is not None
            raw = state.store.block_keys(body.token_ids, tenant=tenant)
        return state, tenant, raw, state.scope(tenant, raw)

    def run(fn: Any, *args: Any, **kwargs: Any) -> Any:
        """A store call, its errors as HTTP statuses."""
        try:
            return fn(*args, **kwargs)
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0] if exc.args else exc)) from None
        except CapacityError as exc:
            raise HTTPException(409, str(exc)) from None
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        except KVStoreError as exc:
            raise HTTPException(503, str(exc)) from None

    @app.post("/v1/cache/pin")
    def pin(body: PinRequest, who: Reader) -> dict[str, Any]:
        """Pin the blocks for ``ttl_s`` seconds at most (404 if one is not held)."""
        state, tenant, _raw, keys = blocks(body, who)
        run(state.store.pin, keys, ttl_s=body.ttl_s, holder=REST_HOLDER)
        state.count(tenant, requests=1)
        return {"tenant": tenant, "pinned": len(keys), "ttl_s": body.ttl_s}

    @app.post("/v1/cache/unpin")
    def unpin(body: BlocksRequest, who: Reader) -> dict[str, Any]:
        """Undo the most recent REST pin of each block (400 if one has none)."""
        state, tenant, _raw, keys = blocks(body, who)
        run(state.store.unpin, keys, holder=REST_HOLDER)
        state.count(tenant, requests=1)
        return {"tenant": tenant, "unpinned": len(keys)}

    @app.post("/v1/cache/prefetch", status_code=202)
    def prefetch(body: BlocksRequest, who: Reader) -> dict[str, Any]:
        """Bring the blocks up to host RAM in the background; returns at once with its id."""
        state, tenant, _raw, keys = blocks(body, who)
        with prefetches_lock:
            done = [i for i, (_t, h) in prefetches.items() if h.done()]
            for old in done[: max(0, len(prefetches) + 1 - MAX_PREFETCHES)]:
                del prefetches[old]
            if len(prefetches) >= MAX_PREFETCHES:
                raise HTTPException(429, f"{len(prefetches)} prefetches are not done, the limit is {MAX_PREFETCHES}")
            handle = run(state.store.prefetch, keys)
            prefetch_id = secrets.token_hex(8)
            prefetches[prefetch_id] = (tenant, handle)
        state.count(tenant, requests=1)
        return {"id": prefetch_id, "tenant": tenant, "num_keys": len(keys), "status": f"/v1/cache/prefetch/{prefetch_id}"}

    @app.get("/v1/cache/prefetch/{prefetch_id}")
    def prefetch_status(prefetch_id: Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")], who: Reader) -> dict[str, Any]:
        """Whether a prefetch is done, and how many of its blocks host RAM then held."""
        with prefetches_lock:
            found = prefetches.get(prefetch_id)
        if found is None or not (found[0] == who.tenant or who.admin or registry.tokens.is_open):
            raise HTTPException(404, f"no prefetch {prefetch_id}")
        handle = found[1]
        done = handle.done()
        return {"id": prefetch_id, "done": done, "num_blocks": run(handle.result) if done else 0,
                "num_keys": handle.num_requested}

    @app.post("/v1/cache/delete")
    def delete(body: DeleteRequest, who: Reader) -> dict[str, Any]:
        """Delete the blocks (and with ``descendants`` their subtree) from every tier."""
        state, tenant, _raw, keys = blocks(body, who)
        deleted = run(state.store.delete, keys, descendants=body.descendants)
        state.count(tenant, requests=1)
        return {"tenant": tenant, "deleted": deleted}

    @app.post("/v1/cache/inspect")
    def inspect(body: BlocksRequest, who: Reader) -> dict[str, Any]:
        """Per block: the tiers holding it, each copy's codec and stored size, its pins."""
        state, tenant, raw, keys = blocks(body, who)
        found = run(state.store.inspect, keys)
        out = []
        for key, info in zip(raw, found, strict=True):
            row = None if info is None else {**info.as_dict(), "key": key.hex()}
            out.append(row)
        state.count(tenant, requests=1)
        return {"namespace": state.id, "tenant": tenant, "blocks": out,
                "num_held": sum(1 for row in out if row is not None)}

    @app.post("/v1/cache/forget")
    def forget(body: ForgetRequest, who: Reader) -> dict[str, Any]:
        """Delete every block of the tenant from every tier of every namespace."""
        tenant = tenant_of(who, body.tenant)
        return dict(run(forget_everywhere, registry, tenant))
