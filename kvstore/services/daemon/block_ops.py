"""The block protocol's data ops (docs/protocol.md): ``hello``, ``lookup``, ``exists``, ``get``,
``put``, ``stats``.

``hello`` opens the session (version, token, model and layout: the namespace); the others
act on the session's namespace, their keys scoped as its tenant's. A socket ``put`` whose
data was received into reserved host slots only publishes them, and a ``get`` of blocks all
in host RAM is answered from their slots (kvstore/services/daemon/host_slots.py).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from kvstore.keys import HASHES
from kvstore.protocol import VERSION, Code, ProtocolError, field_of, layout_from_dict
from kvstore.services.common.tokens import AuthError
from kvstore.services.daemon.host_slots import ReservedPut, commit_put, hold_on_host
from kvstore.services.daemon.op_context import REQUEST_ROOM, Handler, NowHandler, OpContext, Reply
from kvstore.services.daemon.session import Session

# A put's frame is received into a bytearray or bytes; torch.frombuffer warns about the latter.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def hello(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    version = field_of(meta, "version", int)
    if version != VERSION:
        raise ProtocolError(Code.VERSION, f"protocol version {version} is not supported; this daemon speaks {VERSION}")
    try:
        principal = ctx.registry.tokens.authenticate(field_of(meta, "token", (str, type(None)), None))
    except AuthError as exc:
        raise ProtocolError(Code.AUTH, str(exc)) from None
    model_id = field_of(meta, "model_id", str)
    if not model_id or len(model_id) > 256:
        raise ProtocolError(Code.BAD_REQUEST, "model_id must be 1 to 256 characters")
    layout = layout_from_dict(field_of(meta, "layout", dict))
    hash_algo = field_of(meta, "hash_algo", str, "sha256")
    key_bytes = HASHES[hash_algo][1] if hash_algo in HASHES else 0  # an unknown one: open() names it
    max_frame = ctx.config.max_frame
    if layout.bytes_per_block + key_bytes + REQUEST_ROOM > max_frame:
        raise ProtocolError(Code.LAYOUT, f"a block of this layout is {layout.bytes_per_block} bytes: with its key "
                            f"it does not fit this daemon's max_frame of {max_frame} bytes "
                            "(raise max_frame in the daemon's config)")
    state = ctx.registry.open(model_id, layout, hash_algo)
    state.store.know_tenant(principal.tenant)  # its blocks the remote tier delivers are filed under it
    pool = state.store.host_leases.shared_pool
    want_shm = field_of(meta, "shm", bool, False)
    session.principal, session.state = principal, state
    session.shm = bool(want_shm and pool and session.transport == "unix" and principal.shm and ctx.config.shm)
    shm = None
    if session.shm and pool:  # "generations": the pool file carries them (lock-free reads)
        shm = {"path": pool[0], "slot_bytes": pool[1], "num_slots": pool[2], "generations": True}
    return {"version": VERSION, "tenant": principal.tenant, "namespace": state.id,
            "key_bytes": state.store.hasher.key_bytes, "block_bytes": layout.bytes_per_block,
            "max_frame": max_frame, "max_inflight": ctx.config.max_inflight,
            "max_blocks": ctx.max_blocks(state), "max_keys": ctx.max_keys(state), "lease_s": ctx.config.lease_s,
            "shm": shm, "pid": os.getpid()}, b""


def lookup(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    state, tenant, keys = ctx.request_keys(session, meta)
    match = state.store.lookup(keys)
    state.count(tenant, requests=1, lookup_blocks=len(keys), hit_blocks=match.num_blocks)
    return {"num_blocks": match.num_blocks, "tiers": "".join(t[0] for t in match.tiers)}, b""


def exists(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    state, tenant, keys = ctx.request_keys(session, meta)
    state.count(tenant, requests=1)
    return {"found": state.store.contains(keys)}, b""


def get(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    """The leading run of blocks found: in the reply's data, or (``shm``) under a read lease."""
    state, tenant, keys = ctx.request_keys(session, meta)
    ctx.check_batch(state, len(keys))
    if field_of(meta, "shm", bool, False):
        if not session.shm:
            raise ProtocolError(Code.BAD_REQUEST, "this connection has no shared-memory path")
        lease = ctx.leases.grant_read(session.conn_id, state, keys, tenant)
        n = len(lease.slots)
        state.count(tenant, requests=1, get_blocks=n)
        return {"num_blocks": n, "lease": lease.id, "slots": lease.slots, "lease_s": ctx.leases.lease_s}, b""
    layout = state.layout
    held = hold_on_host(ctx, state, keys)
    if held is not None:  # all in host RAM: sent straight from the slots, no copy here
        state.count(tenant, requests=1, get_blocks=len(keys), bytes_out=held.num_bytes)
        return {"num_blocks": len(keys), "tiers": "h" * len(keys)}, held
    out = torch.empty((len(keys), *layout.block_shape), dtype=layout.dtype)
    result = state.store.fetch(keys, into=out).result()  # the tier of each block, as read
    n = result.num_blocks
    size = n * layout.bytes_per_block
    state.count(tenant, requests=1, get_blocks=n, bytes_out=size)
    return {"num_blocks": n, "tiers": "".join(t[0] for t in result.tiers)}, out.view(torch.uint8).numpy().data.cast("B")[:size]


def put(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes | bytearray | ReservedPut) -> Reply:
    if isinstance(data, ReservedPut):
        reply = commit_put(session, data, blocking=True)
        assert reply is not None
        return reply
    state, tenant, keys = ctx.request_keys(session, meta)
    layout = state.layout
    if len(data) != len(keys) * layout.bytes_per_block:
        raise ProtocolError(Code.BAD_REQUEST, f"{len(data)} data bytes for {len(keys)} blocks of "
                            f"{layout.bytes_per_block} bytes")
    if keys:
        blocks = torch.frombuffer(data, dtype=torch.uint8).view(layout.dtype).view(len(keys), *layout.block_shape)
        state.store.put(keys, blocks, tenant=tenant, group=ctx.request_group(state, meta))
    state.count(tenant, requests=1, put_blocks=len(keys), bytes_in=len(data))
    return {"num_blocks": len(keys)}, b""


def put_now(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes | bytearray | ReservedPut) -> Reply | None:
    """``put`` on the event loop: only the commit of one received into reserved slots, when it
    stays in memory and finds the store lock free; else None."""
    if not isinstance(data, ReservedPut):
        return None
    return commit_put(session, data, blocking=False)


def stats(ctx: OpContext, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
    state, principal = session.state, session.principal
    assert state is not None and principal is not None
    return {"namespace": state.id, "tiers": state.store.stats(),
            "tenant": dict(state.counters[principal.tenant])}, b""


HANDLERS: dict[str, Handler] = {"hello": hello, "lookup": lookup, "exists": exists, "get": get, "put": put,
                                "stats": stats}
RUN_NOW: dict[str, NowHandler] = {"put": put_now}
