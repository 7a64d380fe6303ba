"""The block protocol's cache-management ops (docs/protocol.md, "Managing the cache"): ``pin``,
``unpin``, ``delete``, ``prefetch``, ``prefetch_status``, ``inspect``, ``forget``.

One home per management operation on the daemon's side: the protocol's handlers are here;
who may act on whose blocks (``acting_tenant``) and forgetting a tenant everywhere are
kvstore/services/daemon/tenant_admin.py's rules, which REST's routes ask too
(kvstore/services/daemon/rest_cache.py); the store's operations themselves are
``TieredStore``'s. Each op acts on the connection's tenant; the admin token may name another
with ``tenant``. A connection's pins are held as it (``holder=conn_id``) and end with it; its
prefetches are its session's (kvstore/services/daemon/session.py).
"""

from __future__ import annotations

import time
from typing import Any

from kvstore.protocol import Code, ProtocolError, encode, field_of
from kvstore.services.daemon.op_context import Handler, OpContext, Reply
from kvstore.services.daemon.registry import NamespaceState
from kvstore.services.daemon.session import Session
from kvstore.services.daemon.tenant_admin import NotAllowed, UnknownTenant, acting_tenant, forget_everywhere

MAX_STATUS_WAIT_S = 5.0  # the longest a prefetch_status waits for its prefetch
REPLY_ROOM = 16  # bytes of a reply kept for its id


def _tenant(ctx: OpContext, session: Session, meta: dict[str, Any]) -> str:
    """The tenant this request acts on: the connection's, or (admin) the one it names."""
    assert session.principal is not None
    asked = field_of(meta, "tenant", str, None)
    try:
        return acting_tenant(ctx.registry, session.principal, asked)
    except NotAllowed as exc:
        raise ProtocolError(Code.AUTH, str(exc)) from None
    except UnknownTenant as exc:
        raise ProtocolError(Code.NOT_FOUND, str(exc)) from None


def _managed_keys(ctx: OpContext, session: Session, meta: dict[str, Any]) -> tuple[NamespaceState, str, list[bytes]]:
    """The namespace, the acting tenant, and the request's keys scoped as that tenant's."""
    state = session.state
    assert state is not None
    tenant = _tenant(ctx, session, meta)
    return state, tenant, ctx.scoped_keys(state, tenant, meta)


def pin(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    """Pin as this connection: the pins end with it, or after ``ttl_s`` if sooner."""
    state, tenant, keys = _managed_keys(ctx, session, meta)
    ttl_s = field_of(meta, "ttl_s", (int, float, type(None)), None)
    state.store.pin(keys, ttl_s=ttl_s, holder=session.conn_id)
    state.count(tenant, requests=1)
    return {"num_blocks": len(keys)}, b""


def unpin(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    """Undo this connection's most recent pin of each key (BAD_REQUEST for a key this
    connection has not pinned, NOT_FOUND for one not held; nothing undone then)."""
    state, tenant, keys = _managed_keys(ctx, session, meta)
    state.store.unpin(keys, holder=session.conn_id)
    state.count(tenant, requests=1)
    return {"num_blocks": len(keys)}, b""


def cool(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    """Make the blocks every tier's next victims (kvstore.api.BlockStore.cool)."""
    state, tenant, keys = _managed_keys(ctx, session, meta)
    state.count(tenant, requests=1)
    return {"num_blocks": state.store.cool(keys)}, b""


def delete(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    state, tenant, keys = _managed_keys(ctx, session, meta)
    descendants = field_of(meta, "descendants", bool, False)
    state.count(tenant, requests=1)
    return {"num_deleted": state.store.delete(keys, descendants=descendants)}, b""


def prefetch(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    """Start bringing the blocks up to host RAM; answers at once with the prefetch's id."""
    state, tenant, keys = _managed_keys(ctx, session, meta)
    prefetch_id = session.add_prefetch(lambda: state.store.prefetch(keys))
    state.count(tenant, requests=1)
    return {"prefetch": prefetch_id, "num_keys": len(keys)}, b""


def prefetch_status(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    """Whether a prefetch of this connection is done (waiting up to ``wait_s`` for it)."""
    prefetch_id = field_of(meta, "prefetch", int)
    wait_s = field_of(meta, "wait_s", (int, float), 0.0)
    if not 0 <= wait_s <= MAX_STATUS_WAIT_S:
        raise ProtocolError(Code.BAD_REQUEST, f"wait_s must be in [0, {MAX_STATUS_WAIT_S}], got {wait_s!r}")
    handle = session.prefetch(prefetch_id)
    if handle is None:
        raise ProtocolError(Code.NOT_FOUND, f"no prefetch {prefetch_id} on this connection (unknown, or "
                            "reported done already)")
    deadline = time.monotonic() + wait_s
    done = handle.wait(max(0.0, deadline - time.monotonic()))
    if not done:
        return {"done": False, "num_blocks": 0}, b""
    session.drop_prefetch(prefetch_id)
    return {"done": True, "num_blocks": handle.result()}, b""


def inspect(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    state, tenant, keys = _managed_keys(ctx, session, meta)
    state.count(tenant, requests=1)
    blocks: list[dict[str, Any] | None] = []
    for info in state.store.inspect(keys):
        if info is None:
            blocks.append(None)
            continue
        row = info.as_dict()
        del row["key"]  # the key as filed (scoped): the client knows the one it sent
        blocks.append(row)
    reply = {"blocks": blocks}
    size = len(encode(reply)) + REPLY_ROOM
    if size > ctx.config.max_frame:  # a row is ~100 bytes, a key 32: max_keys may not fit
        raise ProtocolError(Code.BAD_REQUEST, f"inspect of {len(keys)} keys: its reply of {size} bytes would "
                            f"exceed max_frame of {ctx.config.max_frame}; ask fewer keys at a time")
    return reply, b""


def forget(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    """Forget a tenant in every namespace of the daemon: the connection's own, or (admin)
    the one named, which the admin must name (its own tenant is rarely meant)."""
    principal = session.principal
    assert principal is not None
    if principal.admin and "tenant" not in meta:
        raise ProtocolError(Code.BAD_REQUEST, "the admin token must name the tenant to forget ('tenant')")
    tenant = _tenant(ctx, session, meta)
    return forget_everywhere(ctx.registry, tenant), b""


HANDLERS: dict[str, Handler] = {"pin": pin, "unpin": unpin, "cool": cool, "delete": delete, "prefetch": prefetch,
                                "prefetch_status": prefetch_status, "inspect": inspect, "forget": forget}
