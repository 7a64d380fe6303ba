"""The block protocol's shared-memory ops (docs/protocol.md, "Shared memory"): ``reserve``,
``commit``, ``release``, ``touch``.

A same-host client on the Unix socket copies blocks straight into and out of the host pool
under leases (kvstore/services/daemon/shm.py): ``reserve`` grants a write lease (free slots
to fill), ``commit`` publishes them, ``release`` ends a read lease (``get`` with ``shm``
grants those) or gives an unused write lease back, and ``touch`` counts a lock-free read.
A commit that stays in memory and finds the store lock free runs on the event loop itself
(``commit_now``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from kvstore.errors import CapacityError
from kvstore.protocol import Code, ProtocolError, field_of
from kvstore.services.daemon.op_context import Handler, NowHandler, OpContext, Reply
from kvstore.services.daemon.session import Session
from kvstore.services.daemon.shm import Lease


def reserve(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    """A write lease: one free host slot per key (evicting for room), and with ``reserve: n``
    also the next put's n slots."""
    state, tenant, keys = ctx.request_keys(session, meta)
    ctx.check_batch(state, len(keys))
    if not session.shm:
        raise ProtocolError(Code.BAD_REQUEST, "this connection has no shared-memory path")
    lease = ctx.leases.grant_write(session.conn_id, state, keys, tenant)
    out: dict[str, Any] = {"lease": lease.id, "slots": lease.slots, "lease_s": ctx.leases.lease_s}
    _reserve_next(ctx, session, lease, field_of(meta, "reserve", int, 0), out)
    return out, b""


def commit(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    """Publish a write lease's slots (under the lease's keys, or the ``keys`` sent now),
    and with ``reserve: n`` take the next put's n slots in the same round trip."""
    reply = _commit_lease(ctx, session, meta, blocking=True)
    assert reply is not None
    return reply


def commit_now(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply | None:
    """``commit`` on the event loop; None (the lease untouched) when it would wait."""
    return _commit_lease(ctx, session, meta, blocking=False)


def _commit_lease(ctx: OpContext, session: Session, meta: dict[str, Any], *, blocking: bool) -> Reply | None:
    """``commit``; without ``blocking``, None (the lease untouched) when the commit would
    wait, and no slots reserved ahead when that would."""
    keys = ctx.request_keys(session, meta)[2] if "keys" in meta else None
    lease = ctx.leases.take(session.conn_id, field_of(meta, "lease", int), "write")
    if lease is None:
        raise ProtocolError(Code.LEASE, "unknown or expired write lease; put the blocks again")
    if keys is not None:
        if len(keys) != len(lease.slots):
            if not blocking:  # giving the slots back waits for the store lock: a worker does
                ctx.leases.put_back(lease)
                return None
            lease.state.store.host_leases.cancel(lease.slots)
            raise ProtocolError(Code.BAD_REQUEST, f"{len(keys)} keys for a lease of {len(lease.slots)} slots")
        lease.keys = keys
    try:
        group = ctx.request_group(lease.state, meta)
        if not lease.state.store.host_leases.commit(lease.keys, lease.slots, tenant=lease.tenant, group=group,
                                                    blocking=blocking):
            ctx.leases.put_back(lease)  # for the worker's try
            return None
    except BaseException:
        lease.state.store.host_leases.cancel(lease.slots)
        raise
    lease.state.count(lease.tenant, requests=1, put_blocks=len(lease.keys))
    out: dict[str, Any] = {"num_blocks": len(lease.keys)}
    _reserve_next(ctx, session, lease, field_of(meta, "reserve", int, 0), out, blocking=blocking)
    return out, b""


def _reserve_next(ctx: OpContext, session: Session, lease: Lease, reserve: int, out: dict[str, Any], *,
                  blocking: bool = True) -> None:
    """With ``reserve: n`` (a reserve or a commit), also take ``n`` free slots for the
    client's next put, as ``out["next"]``. Only from free slots: reserving ahead must never
    evict (it could evict what was just committed); in a full pool the next put reserves
    (and evicts) itself, as it does when, without ``blocking``, the store lock is busy."""
    if 0 < reserve <= ctx.max_blocks(lease.state):
        with contextlib.suppress(CapacityError, ProtocolError):
            nxt = ctx.leases.grant_write(session.conn_id, lease.state, [b""] * reserve, lease.tenant,
                                         evict=False, blocking=blocking)
            if nxt is not None:
                out["next"] = {"lease": nxt.id, "slots": nxt.slots, "lease_s": ctx.leases.lease_s}


def release(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    """End a read lease (``valid``: it had not expired), or give an unused write lease's
    slots back (``kind: "write"``; the client promises it never wrote them)."""
    kind = field_of(meta, "kind", str, "read")
    if kind not in ("read", "write"):
        raise ProtocolError(Code.BAD_REQUEST, f"kind must be 'read' or 'write', got {kind[:20]!r}")
    lease = ctx.leases.take(session.conn_id, field_of(meta, "lease", int), kind)
    if lease is not None and kind == "read":
        lease.state.store.host_leases.release(lease.keys)
    elif lease is not None:
        lease.state.store.host_leases.cancel(lease.slots)
    return {"valid": lease is not None}, b""


def touch(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    """A client copied these blocks lock-free: count the read and refresh their recency
    (as a get would; a block demoted meanwhile is promoted back, it was just used)."""
    state, tenant, keys = ctx.request_keys(session, meta)
    if not session.shm:
        raise ProtocolError(Code.BAD_REQUEST, "this connection has no shared-memory path")
    slots = state.store.host_leases.acquire(keys)
    state.store.host_leases.release(keys[: len(slots)])
    state.count(tenant, requests=1, get_blocks=len(slots))
    return {"num_blocks": len(slots)}, b""


HANDLERS: dict[str, Handler] = {"reserve": reserve, "commit": commit, "release": release, "touch": touch}
RUN_NOW: dict[str, NowHandler] = {"commit": commit_now}
