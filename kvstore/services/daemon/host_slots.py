"""A socket request's blocks moved straight between the socket and host-pool slots, uncopied.

Put: before a put's data is read, ``reserve_put`` takes host slots for its blocks
(``HostLeases.reserve``); the connection receives the data section straight into them
(``ReservedPut.views``), and the put then only publishes them (``commit_put``:
``HostLeases.commit``), or gives them back if the connection closes first (``cancel_put``).
Get: when host RAM holds every block asked for, ``hold_on_host`` holds them there (as a read
lease does) and the reply is written from their slots (``HeldBlocks``); the connection
releases them once the reply is written.

Both need the host pool mapped in this process too: a shared pool (the daemon's default).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.errors import KVStoreError
from kvstore.protocol import ProtocolError
from kvstore.services.daemon.op_context import OpContext, Reply
from kvstore.services.daemon.registry import NamespaceState
from kvstore.services.daemon.session import Session


@dataclass
class ReservedPut:
    """A socket put whose blocks the connection receives straight into reserved host slots.

    ``views`` are the slots' payloads in block order, one view per run of adjacent slots
    when a slot holds exactly one payload; the put then only publishes the slots.
    """

    state: NamespaceState
    keys: list[bytes]  # scoped to the tenant
    slots: list[int]
    views: list[memoryview]
    num_bytes: int
    group: int | None = None  # the KV group the put named


@dataclass
class HeldBlocks:
    """A socket get's reply data, not copied: ``views`` of the host slots of its blocks, in
    block order, held in host RAM (as read leases are) until ``release`` runs. The
    connection writes them straight from the pool, then releases them."""

    views: list[memoryview]
    num_bytes: int
    release: Callable[..., bool]  # release(blocking=True): see HostLeases.release
    let_go: bool = False  # release was called (or handed to a worker)

    def __len__(self) -> int:
        return self.num_bytes


def reserve_put(ctx: OpContext, session: Session, meta: dict[str, Any], data_len: int, *,
                blocking: bool = True) -> ReservedPut | None:
    """Host slots to receive a put's blocks in, before its data is read; or None: the data
    then goes to a buffer and ``store.put`` (which also reports any error). Without
    ``blocking`` (the event loop asks) only slots already free are taken, and None also
    means the store lock was busy: ask again with ``blocking`` on a worker.

    Only a put of blocks the store holds nowhere (the common case: an engine stores what it
    just computed) takes this path, so it has ``put``'s semantics exactly: a held key is only
    refreshed, and a put bigger than half the host tier, or one that finds no free host slot,
    is stored by ``put`` (in chunks, overflowing to disk).
    """
    state, principal = session.state, session.principal
    if state is None or principal is None or meta.get("op") != "put":
        return None
    try:
        keys = ctx.request_keys(session, meta)[2]
        group = ctx.request_group(state, meta)
        pool = state.store.host_leases.shared_pool
        n, payload = len(keys), state.layout.bytes_per_block
        if pool is None or n == 0 or data_len != n * payload or n > pool[2] // 2:
            return None
        held = state.store.contains(keys, blocking=blocking)
        if held is None or any(held):
            return None
        ctx.pools.get(state.id, pool)  # mapped before any slot is taken
        slots = state.store.host_leases.reserve(n, blocking=blocking)
        if slots is None:
            return None
    except (ProtocolError, KVStoreError, OSError, ValueError):
        return None
    return ReservedPut(state, keys, slots, slot_views(ctx, state, pool, slots), data_len, group)


def cancel_put(reserved: ReservedPut) -> None:
    """Give a reserved put's slots back (its connection closed before the data came)."""
    with contextlib.suppress(KVStoreError):
        reserved.state.store.host_leases.cancel(reserved.slots)


def commit_put(session: Session, data: ReservedPut, *, blocking: bool) -> Reply | None:
    """Publish a received put's slots: ``put``'s reply. Without ``blocking``, None when that
    would wait (the slots stay reserved for a worker's try)."""
    store, principal = data.state.store, session.principal
    assert principal is not None
    try:
        if not store.host_leases.commit(data.keys, data.slots, tenant=principal.tenant, group=data.group,
                                        blocking=blocking):
            return None
    except BaseException:
        store.host_leases.cancel(data.slots)
        raise
    data.state.count(principal.tenant, requests=1, put_blocks=len(data.keys), bytes_in=data.num_bytes)
    return {"num_blocks": len(data.keys)}, b""


def hold_on_host(ctx: OpContext, state: NamespaceState, keys: list[bytes]) -> HeldBlocks | None:
    """Hold ``keys`` in host RAM for a reply written straight from their slots, if host RAM
    holds every one (raw) and its pool is mapped here too; else None."""
    pool = state.store.host_leases.shared_pool
    if pool is None or not keys:
        return None
    try:
        slots = state.store.host_leases.acquire(keys, host_only=True)
    except KVStoreError:  # a host codec: slots hold encoded blocks
        return None
    if not slots:
        return None
    try:
        views = slot_views(ctx, state, pool, slots)
    except BaseException:
        state.store.host_leases.release(keys)
        raise
    return HeldBlocks(views, len(keys) * state.layout.bytes_per_block,
                      functools.partial(state.store.host_leases.release, keys))


def slot_views(ctx: OpContext, state: NamespaceState, pool: tuple[str, int, int],
               slots: list[int]) -> list[memoryview]:
    """The payloads of host ``slots`` in order, in this process's mapping of the pool: one
    view per run of adjacent slots when a slot holds exactly one payload."""
    mapped = ctx.pools.get(state.id, pool).view
    slot_bytes, payload = pool[1], state.layout.bytes_per_block
    views = []
    for start, count in runs(slots):
        if slot_bytes == payload:
            views.append(mapped[start * slot_bytes : (start + count) * slot_bytes])
        else:
            views += [mapped[s * slot_bytes : s * slot_bytes + payload] for s in range(start, start + count)]
    return views


def runs(slots: list[int]) -> list[tuple[int, int]]:
    """``(first slot, count)`` of each run of consecutive slot ids, in order."""
    found: list[tuple[int, int]] = []
    for slot in slots:
        if found and slot == found[-1][0] + found[-1][1]:
            found[-1] = (found[-1][0], found[-1][1] + 1)
        else:
            found.append((slot, 1))
    return found
