"""REST's cache-management routes (docs/rest.md, "Managing the cache"): ``/v1/cache/*``, the
admin's ``/v1/admin/flush``, and the deprecated aliases ``/v1/admin/pin`` and ``/v1/admin/evict``.

One home per management operation on the daemon's side: REST's routes are here; who may act
on whose blocks (``acting_tenant``) and forgetting a tenant everywhere are
kvstore/services/daemon/tenant_admin.py's rules, which the block protocol's handlers ask too
(kvstore/services/daemon/manage_ops.py); the store's operations themselves are
``TieredStore``'s.

Every ``/v1/cache/*`` route acts on the caller's tenant (its token's; an open daemon's is
``""``); the admin token may name another with ``tenant``. Blocks are named by ``token_ids``
(the tenant's chain of that prompt) or by ``keys`` (the tenant's block keys, hex, as its
client computes them); the daemon scopes them as the tenant's, as it does every key a
connection sends. A pin over REST has no connection to end with it, so it needs
a ``ttl_s``. Errors: 400 bad input (a bound named), 401/403 tokens, 404 unknown tenant,
namespace or prefetch, 409 a block pinned or being read, 429 too many prefetches pending.

The ``/v1/admin/*`` routes need the admin token and take stored keys (or, with ``tenant``, a
tenant's client keys). ``/v1/admin/pin`` and ``/v1/admin/evict`` are deprecated aliases of
``/v1/cache/pin`` and ``/v1/cache/delete`` (docs/rest.md, "Deprecated routes"): they answer
as they always did, marked as deprecated (``rest_common.deprecated_alias``).
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path
from pydantic import BaseModel, Field, model_validator

from kvstore.api import MAX_KEYS, MAX_PIN_TTL_S
from kvstore.errors import CapacityError, KVStoreError
from kvstore.results import PrefetchHandle
from kvstore.services.common.tokens import Principal
from kvstore.services.daemon.registry import NamespaceState, Registry
from kvstore.services.daemon.rest_common import Admin, HexKey, Reader, TokenId, deprecated_alias, namespaces
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


class KeysRequest(BaseModel):
    keys: list[HexKey] = Field(min_length=1, max_length=1 << 16, description="block keys, hex")
    namespace: str | None = Field(None, max_length=64)
    tenant: str | None = Field(None, max_length=256, description="scope the keys as this tenant's client keys")
    unpin: bool = False


class FlushRequest(BaseModel):
    namespace: str | None = Field(None, max_length=64)
    tenant: str | None = Field(None, max_length=256)


def cache_router(registry: Registry) -> APIRouter:
    """The cache-management routes over ``registry``."""
    router = APIRouter()
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

    @router.post("/v1/cache/pin")
    def pin(body: PinRequest, who: Reader) -> dict[str, Any]:
        """Pin the blocks for ``ttl_s`` seconds at most (404 if one is not held)."""
        state, tenant, _raw, keys = blocks(body, who)
        run(state.store.pin, keys, ttl_s=body.ttl_s, holder=REST_HOLDER)
        state.count(tenant, requests=1)
        return {"tenant": tenant, "pinned": len(keys), "ttl_s": body.ttl_s}

    @router.post("/v1/cache/unpin")
    def unpin(body: BlocksRequest, who: Reader) -> dict[str, Any]:
        """Undo the most recent REST pin of each block (400 if one has none)."""
        state, tenant, _raw, keys = blocks(body, who)
        run(state.store.unpin, keys, holder=REST_HOLDER)
        state.count(tenant, requests=1)
        return {"tenant": tenant, "unpinned": len(keys)}

    @router.post("/v1/cache/prefetch", status_code=202)
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

    @router.get("/v1/cache/prefetch/{prefetch_id}")
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

    @router.post("/v1/cache/delete")
    def delete(body: DeleteRequest, who: Reader) -> dict[str, Any]:
        """Delete the blocks (and with ``descendants`` their subtree) from every tier."""
        state, tenant, _raw, keys = blocks(body, who)
        deleted = run(state.store.delete, keys, descendants=body.descendants)
        state.count(tenant, requests=1)
        return {"tenant": tenant, "deleted": deleted}

    @router.post("/v1/cache/inspect")
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

    @router.post("/v1/cache/forget")
    def forget(body: ForgetRequest, who: Reader) -> dict[str, Any]:
        """Delete every block of the tenant from every tier of every namespace."""
        tenant = tenant_of(who, body.tenant)
        return dict(run(forget_everywhere, registry, tenant))

    def stored_keys(body: KeysRequest) -> list[tuple[NamespaceState, list[bytes]]]:
        """Per namespace, the body's keys of its width: as stored, or scoped as ``tenant``'s."""
        out = []
        for state in namespaces(registry, body.namespace):
            raw = [bytes.fromhex(k) for k in body.keys]
            raw = [k for k in raw if len(k) == state.store.hasher.key_bytes]
            out.append((state, state.scope(body.tenant, raw) if body.tenant is not None else raw))
        return out

    @router.post("/v1/admin/flush")
    def flush(body: FlushRequest, who: Admin) -> dict[str, Any]:
        """Delete every block not pinned or being read (of one namespace / tenant if named)."""
        deleted = skipped = 0
        for state in namespaces(registry, body.namespace):
            for key in state.store.view.held_keys(body.tenant):
                try:
                    deleted += state.store.delete([key])
                except CapacityError:
                    skipped += 1
        return {"deleted": deleted, "skipped": skipped}

    def admin_pin(body: KeysRequest, who: Admin) -> dict[str, Any]:
        """Deprecated: use ``/v1/cache/pin`` (and ``/v1/cache/unpin``). Pin (or with
        ``unpin: true`` unpin) blocks by stored key, or by a tenant's client keys; these pins
        have no holder and no TTL."""
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

    def admin_evict(body: KeysRequest, who: Admin) -> dict[str, Any]:
        """Deprecated: use ``/v1/cache/delete``. Remove blocks from every tier (409 if one is
        pinned or being read)."""
        evicted = 0
        for state, keys in stored_keys(body):
            try:
                evicted += state.store.delete(keys)
            except CapacityError as exc:
                raise HTTPException(409, str(exc)) from None
        return {"evicted": evicted}

    # name=: the OpenAPI operation ids stay those of the routes' first spelling
    router.add_api_route("/v1/admin/pin", admin_pin, methods=["POST"], name="pin", deprecated=True,
                         route_class_override=deprecated_alias("/v1/cache/pin"))
    router.add_api_route("/v1/admin/evict", admin_evict, methods=["POST"], name="evict", deprecated=True,
                         route_class_override=deprecated_alias("/v1/cache/delete"))
    return router
