"""The block protocol's operations: one synchronous handler per op, run on a worker thread
(``handle``), or by the event loop itself for a commit that waits on nothing (``handle_now``).

Each handler takes the session (who is asking, in which namespace), the request's meta map
and its raw data, and returns the response's meta map and raw data. Every failure becomes a
ProtocolError with a code; the server turns it into an error frame.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.client.pool_map import MappedPool
from kvstore.errors import (
    CapacityError,
    CodecError,
    ConfigError,
    KVStoreError,
    LayoutMismatchError,
    TierError,
    TierFullError,
)
from kvstore.keys import HASHES
from kvstore.protocol import VERSION, Code, ProtocolError, field_of, layout_from_dict, split_keys
from kvstore.results import PrefetchHandle
from kvstore.services.common.tokens import AuthError, Principal
from kvstore.services.daemon.cache_ops import CacheOps
from kvstore.services.daemon.config import DaemonConfig
from kvstore.services.daemon.registry import NamespaceState, Registry
from kvstore.services.daemon.shm import Lease, Leases

MAX_KEYS = 1 << 16  # keys in one request (fewer where they would not fit a frame: Ops.max_keys)
REQUEST_ROOM = 1 << 10  # bytes of a frame kept for a request's fields besides its keys and blocks
log = logging.getLogger("kvstore.services.daemon")
warnings.filterwarnings("ignore", message="The given buffer is not writable")

Reply = tuple[dict[str, Any], Any]


@dataclass
class ReservedPut:
    """A socket put whose blocks the connection receives straight into reserved host slots.

    ``views`` are the slots' payloads in block order, one view per run of adjacent slots
    when a slot holds exactly one payload; ``op_put`` then only publishes the slots.
    """

    state: NamespaceState
    keys: list[bytes]  # scoped to the tenant
    slots: list[int]
    views: list[memoryview]
    num_bytes: int


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


@dataclass
class Session:
    """One connection's state: set by hello, read by every later op."""

    conn_id: int
    transport: str  # "unix" or "tcp"
    principal: Principal | None = None
    state: NamespaceState | None = None
    shm: bool = False
    prefetches: dict[int, PrefetchHandle] = field(default_factory=dict)  # not yet reported done
    num_prefetches: int = 0

    def unpin_all(self) -> None:
        """A connection's pins end with it (its pins are held as ``holder=conn_id``, TTL or
        not): a dead client cannot pin blocks forever. Its prefetches are dropped."""
        self.prefetches.clear()
        if self.state is not None:
            try:
                self.state.store.end_pins(self.conn_id)
            except KVStoreError:
                log.warning("could not end the pins of closed connection %d", self.conn_id)


@dataclass
class Ops(CacheOps):
    config: DaemonConfig
    registry: Registry
    leases: Leases
    requests: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    _pools: dict[str, MappedPool] = field(default_factory=dict)  # namespace id -> its host pool, mapped
    _pools_lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, session: Session, meta: dict[str, Any], data: bytes | bytearray | ReservedPut) -> Reply:
        """Run one request; returns (meta, data) of the response or of an error frame."""
        reply = self._run(session, meta, data, blocking=True)
        assert reply is not None
        return reply

    def handle_now(self, session: Session, meta: dict[str, Any], data: bytes | bytearray | ReservedPut) -> Reply | None:
        """Run a request on the caller's thread (the event loop's) only if it waits on
        nothing: the commit of a put received into reserved slots, or of a shared-memory
        write lease, when it stays in memory (no write-through, no shared level taking puts)
        and finds the store lock free. None: nothing was done; run ``handle`` on a worker."""
        op = meta.get("op")
        if session.principal is None or not (op == "commit" or (op == "put" and isinstance(data, ReservedPut))):
            return None
        return self._run(session, meta, data, blocking=False)

    def _run(self, session: Session, meta: dict[str, Any], data: bytes | bytearray | ReservedPut, *,
             blocking: bool) -> Reply | None:
        rid = meta.get("id")
        op = meta.get("op")
        ran: str | None = None  # the op, once it runs: a request, whether it succeeds or fails
        try:
            if not isinstance(op, str):
                raise ProtocolError(Code.BAD_REQUEST, "field 'op' must be a string")
            handler: Callable[[Session, dict[str, Any], Any], Reply] | None = getattr(self, f"op_{op}", None)
            if handler is None:
                raise ProtocolError(Code.UNKNOWN_OP, f"unknown op {op[:40]!r}")
            if op == "hello" and session.principal is not None:
                raise ProtocolError(Code.STATE, "hello was already sent on this connection")
            if op != "hello" and session.principal is None:
                raise ProtocolError(Code.STATE, f"op {op!r} before hello")
            ran = op
            if blocking:
                reply: Reply | None = handler(session, meta, data)
            else:
                reply = (self._commit_put(session, data, blocking=False) if isinstance(data, ReservedPut)
                         else self._commit_lease(session, meta, blocking=False))
            if reply is None:
                ran = None  # nothing was done: the worker's run is the request
                return None
            out, payload = reply
            out["id"] = rid
            return out, payload
        except ProtocolError as exc:
            code, message = exc.code, exc.message
        except KeyError as exc:
            code, message = Code.NOT_FOUND, str(exc.args[0] if exc.args else exc)
        except (CapacityError, TierFullError) as exc:  # a full disk is no room, as a full pool is
            code, message = Code.CAPACITY, str(exc)
        except (LayoutMismatchError, ConfigError) as exc:
            code, message = Code.LAYOUT, str(exc)
        except TierError as exc:  # e.g. a write-through put whose disk write failed: not acknowledged
            code, message = Code.STORAGE, str(exc)
        except CodecError as exc:  # a block the store's codec refuses (NaN, a scale out of range)
            code, message = Code.BAD_REQUEST, str(exc)
        except KVStoreError as exc:  # the store is closed: the daemon is going away
            code, message = Code.SHUTDOWN, str(exc)
        except (TypeError, ValueError) as exc:
            code, message = Code.BAD_REQUEST, str(exc)
        except Exception as exc:  # a bug: report it, keep serving
            log.exception("op %r failed", op)
            code, message = Code.INTERNAL, f"{type(exc).__name__}: {exc}"
        finally:
            if ran is not None:
                self.requests[ran] += 1
        self.errors[code.name] += 1
        if session.state is not None and session.principal is not None:
            session.state.count(session.principal.tenant, errors=1)
        rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else None
        return {"id": rid, "error": {"code": int(code), "message": message[:2000]}}, b""

    # --------------------------------------------------------------------------- helpers

    def _keys(self, session: Session, meta: dict[str, Any]) -> tuple[NamespaceState, str, list[bytes]]:
        state, principal = session.state, session.principal
        assert state is not None and principal is not None
        blob = field_of(meta, "keys", bytes)
        keys = split_keys(blob, state.store.hasher.key_bytes)
        if len(keys) > self.max_keys(state):
            raise ProtocolError(Code.BAD_REQUEST, f"{len(keys)} keys in one request, the limit is {self.max_keys(state)}")
        return state, principal.tenant, state.scope(principal.tenant, keys)

    def max_keys(self, state: NamespaceState) -> int:
        """Keys one request may carry: ``MAX_KEYS``, or fewer where they would not fit a frame."""
        return min(MAX_KEYS, (self.config.max_frame - REQUEST_ROOM) // state.store.hasher.key_bytes)

    def max_blocks(self, state: NamespaceState) -> int:
        """Blocks one put or get may carry: each with its key in the request and its bytes in
        the frame (hello made sure that one fits)."""
        per_block = state.layout.bytes_per_block + state.store.hasher.key_bytes
        return max(1, min(self.max_keys(state), (self.config.max_frame - REQUEST_ROOM) // per_block))

    def _check_batch(self, state: NamespaceState, n: int) -> None:
        if n > self.max_blocks(state):
            raise ProtocolError(Code.BAD_REQUEST, f"{n} blocks in one request, at most {self.max_blocks(state)} "
                                f"fit a {self.config.max_frame}-byte frame")

    # --------------------------------------------------------------------------- ops

    def op_hello(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        version = field_of(meta, "version", int)
        if version != VERSION:
            raise ProtocolError(Code.VERSION, f"protocol version {version} is not supported; this daemon speaks {VERSION}")
        try:
            principal = self.registry.tokens.authenticate(field_of(meta, "token", (str, type(None)), None))
        except AuthError as exc:
            raise ProtocolError(Code.AUTH, str(exc)) from None
        model_id = field_of(meta, "model_id", str)
        if not model_id or len(model_id) > 256:
            raise ProtocolError(Code.BAD_REQUEST, "model_id must be 1 to 256 characters")
        layout = layout_from_dict(field_of(meta, "layout", dict))
        hash_algo = field_of(meta, "hash_algo", str, "sha256")
        key_bytes = HASHES[hash_algo][1] if hash_algo in HASHES else 0  # an unknown one: open() names it
        if layout.bytes_per_block + key_bytes + REQUEST_ROOM > self.config.max_frame:
            raise ProtocolError(Code.LAYOUT, f"a block of this layout is {layout.bytes_per_block} bytes: with its key "
                                f"it does not fit this daemon's max_frame of {self.config.max_frame} bytes "
                                "(raise max_frame in the daemon's config)")
        state = self.registry.open(model_id, layout, hash_algo)
        state.store.know_tenant(principal.tenant)  # its blocks the remote tier delivers are filed under it
        pool = state.store.host_leases.shared_pool
        want_shm = field_of(meta, "shm", bool, False)
        session.principal, session.state = principal, state
        session.shm = bool(want_shm and pool and session.transport == "unix" and principal.shm and self.config.shm)
        shm = None
        if session.shm and pool:  # "generations": the pool file carries them (lock-free reads)
            shm = {"path": pool[0], "slot_bytes": pool[1], "num_slots": pool[2], "generations": True}
        return {"version": VERSION, "tenant": principal.tenant, "namespace": state.id,
                "key_bytes": state.store.hasher.key_bytes, "block_bytes": layout.bytes_per_block,
                "max_frame": self.config.max_frame, "max_inflight": self.config.max_inflight,
                "max_blocks": self.max_blocks(state), "max_keys": self.max_keys(state), "lease_s": self.config.lease_s,
                "shm": shm, "pid": os.getpid()}, b""

    def op_lookup(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        state, tenant, keys = self._keys(session, meta)
        match = state.store.lookup(keys)
        state.count(tenant, requests=1, lookup_blocks=len(keys), hit_blocks=match.num_blocks)
        return {"num_blocks": match.num_blocks, "tiers": "".join(t[0] for t in match.tiers)}, b""

    def op_exists(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        state, tenant, keys = self._keys(session, meta)
        state.count(tenant, requests=1)
        return {"found": state.store.contains(keys)}, b""

    def op_get(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        state, tenant, keys = self._keys(session, meta)
        self._check_batch(state, len(keys))
        if field_of(meta, "shm", bool, False):
            if not session.shm:
                raise ProtocolError(Code.BAD_REQUEST, "this connection has no shared-memory path")
            lease = self.leases.grant_read(session.conn_id, state, keys, tenant)
            n = len(lease.slots)
            state.count(tenant, requests=1, get_blocks=n)
            return {"num_blocks": n, "lease": lease.id, "slots": lease.slots, "lease_s": self.leases.lease_s}, b""
        layout = state.layout
        held = self._hold_on_host(state, keys)
        if held is not None:  # all in host RAM: sent straight from the slots, no copy here
            state.count(tenant, requests=1, get_blocks=len(keys), bytes_out=held.num_bytes)
            return {"num_blocks": len(keys), "tiers": "h" * len(keys)}, held
        out = torch.empty((len(keys), *layout.block_shape), dtype=layout.dtype)
        result = state.store.fetch(keys, into=out).result()  # the tier of each block, as read
        n = result.num_blocks
        size = n * layout.bytes_per_block
        state.count(tenant, requests=1, get_blocks=n, bytes_out=size)
        return {"num_blocks": n, "tiers": "".join(t[0] for t in result.tiers)}, out.view(torch.uint8).numpy().data.cast("B")[:size]

    def _hold_on_host(self, state: NamespaceState, keys: list[bytes]) -> HeldBlocks | None:
        """Hold ``keys`` in host RAM for a reply written straight from their slots, if host
        RAM holds every one (raw) and its pool is mapped here too; else None."""
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
            views = self._slot_views(state, pool, slots)
        except BaseException:
            state.store.host_leases.release(keys)
            raise
        return HeldBlocks(views, len(keys) * state.layout.bytes_per_block,
                          functools.partial(state.store.host_leases.release, keys))

    def _slot_views(self, state: NamespaceState, pool: tuple[str, int, int], slots: list[int]) -> list[memoryview]:
        """The payloads of host ``slots`` in order, in this process's mapping of the pool:
        one view per run of adjacent slots when a slot holds exactly one payload."""
        mapped = self._mapped_pool(state.id, pool).view
        slot_bytes, payload = pool[1], state.layout.bytes_per_block
        views = []
        for start, count in _runs(slots):
            if slot_bytes == payload:
                views.append(mapped[start * slot_bytes : (start + count) * slot_bytes])
            else:
                views += [mapped[s * slot_bytes : s * slot_bytes + payload] for s in range(start, start + count)]
        return views

    def reserve_put(self, session: Session, meta: dict[str, Any], data_len: int, *,
                    blocking: bool = True) -> ReservedPut | None:
        """Host slots to receive a put's blocks in, before its data is read; or None: the
        data then goes to a buffer and ``store.put`` (which also reports any error). Without
        ``blocking`` (the event loop asks) only slots already free are taken, and None also
        means the store lock was busy: ask again with ``blocking`` on a worker.

        Only a put of blocks the store holds nowhere (the common case: an engine stores what
        it just computed) takes this path, so it has ``put``'s semantics exactly: a held key
        is only refreshed, and a put bigger than half the host tier, or one that finds no
        free host slot, is stored by ``put`` (in chunks, overflowing to disk). It needs the
        host pool mapped in this process too: a shared pool (the daemon's default).
        """
        state, principal = session.state, session.principal
        if state is None or principal is None or meta.get("op") != "put":
            return None
        try:
            keys = self._keys(session, meta)[2]
            pool = state.store.host_leases.shared_pool
            n, payload = len(keys), state.layout.bytes_per_block
            if pool is None or n == 0 or data_len != n * payload or n > pool[2] // 2:
                return None
            held = state.store.contains(keys, blocking=blocking)
            if held is None or any(held):
                return None
            self._mapped_pool(state.id, pool)  # mapped before any slot is taken
            slots = state.store.host_leases.reserve(n, blocking=blocking)
            if slots is None:
                return None
        except (ProtocolError, KVStoreError, OSError, ValueError):
            return None
        return ReservedPut(state, keys, slots, self._slot_views(state, pool, slots), data_len)

    def cancel_put(self, reserved: ReservedPut) -> None:
        """Give a reserved put's slots back (its connection closed before the data came)."""
        with contextlib.suppress(KVStoreError):
            reserved.state.store.host_leases.cancel(reserved.slots)

    def _mapped_pool(self, namespace: str, pool: tuple[str, int, int]) -> MappedPool:
        with self._pools_lock:
            if namespace not in self._pools:
                self._pools[namespace] = MappedPool(*pool)
            return self._pools[namespace]

    def op_put(self, session: Session, meta: dict[str, Any], data: bytes | bytearray | ReservedPut) -> Reply:
        if isinstance(data, ReservedPut):
            reply = self._commit_put(session, data, blocking=True)
            assert reply is not None
            return reply
        state, tenant, keys = self._keys(session, meta)
        layout = state.layout
        if len(data) != len(keys) * layout.bytes_per_block:
            raise ProtocolError(Code.BAD_REQUEST, f"{len(data)} data bytes for {len(keys)} blocks of "
                                f"{layout.bytes_per_block} bytes")
        if keys:
            blocks = torch.frombuffer(data, dtype=torch.uint8).view(layout.dtype).view(len(keys), *layout.block_shape)
            state.store.put(keys, blocks, tenant=tenant)
        state.count(tenant, requests=1, put_blocks=len(keys), bytes_in=len(data))
        return {"num_blocks": len(keys)}, b""

    def _commit_put(self, session: Session, data: ReservedPut, *, blocking: bool) -> Reply | None:
        """Publish a received put's slots; without ``blocking``, None when that would wait."""
        store, principal = data.state.store, session.principal
        assert principal is not None
        try:
            if not store.host_leases.commit(data.keys, data.slots, tenant=principal.tenant, blocking=blocking):
                return None  # nothing was done: the slots stay reserved for the worker's try
        except BaseException:
            store.host_leases.cancel(data.slots)
            raise
        data.state.count(principal.tenant, requests=1, put_blocks=len(data.keys), bytes_in=data.num_bytes)
        return {"num_blocks": len(data.keys)}, b""

    def op_reserve(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        state, tenant, keys = self._keys(session, meta)
        self._check_batch(state, len(keys))
        if not session.shm:
            raise ProtocolError(Code.BAD_REQUEST, "this connection has no shared-memory path")
        lease = self.leases.grant_write(session.conn_id, state, keys, tenant)
        out: dict[str, Any] = {"lease": lease.id, "slots": lease.slots, "lease_s": self.leases.lease_s}
        self._reserve_next(session, lease, field_of(meta, "reserve", int, 0), out)
        return out, b""

    def op_commit(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        """Publish a write lease's slots (under the lease's keys, or the ``keys`` sent now),
        and with ``reserve: n`` take the next put's n slots in the same round trip."""
        reply = self._commit_lease(session, meta, blocking=True)
        assert reply is not None
        return reply

    def _commit_lease(self, session: Session, meta: dict[str, Any], *, blocking: bool) -> Reply | None:
        """``op_commit``; without ``blocking``, None (the lease untouched) when the commit
        would wait, and no slots reserved ahead when that would."""
        keys = self._keys(session, meta)[2] if "keys" in meta else None
        lease = self.leases.take(session.conn_id, field_of(meta, "lease", int), "write")
        if lease is None:
            raise ProtocolError(Code.LEASE, "unknown or expired write lease; put the blocks again")
        if keys is not None:
            if len(keys) != len(lease.slots):
                if not blocking:  # giving the slots back waits for the store lock: a worker does
                    self.leases.put_back(lease)
                    return None
                lease.state.store.host_leases.cancel(lease.slots)
                raise ProtocolError(Code.BAD_REQUEST, f"{len(keys)} keys for a lease of {len(lease.slots)} slots")
            lease.keys = keys
        try:
            if not lease.state.store.host_leases.commit(lease.keys, lease.slots, tenant=lease.tenant, blocking=blocking):
                self.leases.put_back(lease)  # for the worker's try
                return None
        except BaseException:
            lease.state.store.host_leases.cancel(lease.slots)
            raise
        lease.state.count(lease.tenant, requests=1, put_blocks=len(lease.keys))
        out: dict[str, Any] = {"num_blocks": len(lease.keys)}
        self._reserve_next(session, lease, field_of(meta, "reserve", int, 0), out, blocking=blocking)
        return out, b""

    def _reserve_next(self, session: Session, lease: Lease, reserve: int, out: dict[str, Any], *,
                      blocking: bool = True) -> None:
        """With ``reserve: n`` (a reserve or a commit), also take ``n`` free slots for the
        client's next put, as ``out["next"]``. Only from free slots: reserving ahead must never
        evict (it could evict what was just committed); in a full pool the next put reserves
        (and evicts) itself, as it does when, without ``blocking``, the store lock is busy."""
        if 0 < reserve <= self.max_blocks(lease.state):
            with contextlib.suppress(CapacityError, ProtocolError):
                nxt = self.leases.grant_write(session.conn_id, lease.state, [b""] * reserve, lease.tenant,
                                              evict=False, blocking=blocking)
                if nxt is not None:
                    out["next"] = {"lease": nxt.id, "slots": nxt.slots, "lease_s": self.leases.lease_s}

    def op_release(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        """End a read lease (``valid``: it had not expired), or give an unused write lease's
        slots back (``kind: "write"``; the client promises it never wrote them)."""
        kind = field_of(meta, "kind", str, "read")
        if kind not in ("read", "write"):
            raise ProtocolError(Code.BAD_REQUEST, f"kind must be 'read' or 'write', got {kind[:20]!r}")
        lease = self.leases.take(session.conn_id, field_of(meta, "lease", int), kind)
        if lease is not None and kind == "read":
            lease.state.store.host_leases.release(lease.keys)
        elif lease is not None:
            lease.state.store.host_leases.cancel(lease.slots)
        return {"valid": lease is not None}, b""

    def op_touch(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        """A client copied these blocks lock-free: count the read and refresh their recency
        (as a get would; a block demoted meanwhile is promoted back, it was just used)."""
        state, tenant, keys = self._keys(session, meta)
        if not session.shm:
            raise ProtocolError(Code.BAD_REQUEST, "this connection has no shared-memory path")
        slots = state.store.host_leases.acquire(keys)
        state.store.host_leases.release(keys[: len(slots)])
        state.count(tenant, requests=1, get_blocks=len(slots))
        return {"num_blocks": len(slots)}, b""

    def op_pin(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        """Pin as this connection: the pins end with it, or after ``ttl_s`` if sooner."""
        state, tenant, keys = self._managed_keys(session, meta)
        ttl_s = field_of(meta, "ttl_s", (int, float, type(None)), None)
        state.store.pin(keys, ttl_s=ttl_s, holder=session.conn_id)
        state.count(tenant, requests=1)
        return {"num_blocks": len(keys)}, b""

    def op_unpin(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        """Undo this connection's most recent pin of each key (BAD_REQUEST for a key this
        connection has not pinned, NOT_FOUND for one not held; nothing undone then)."""
        state, tenant, keys = self._managed_keys(session, meta)
        state.store.unpin(keys, holder=session.conn_id)
        state.count(tenant, requests=1)
        return {"num_blocks": len(keys)}, b""

    def op_delete(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        state, tenant, keys = self._managed_keys(session, meta)
        descendants = field_of(meta, "descendants", bool, False)
        state.count(tenant, requests=1)
        return {"num_deleted": state.store.delete(keys, descendants=descendants)}, b""

    def op_stats(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        state, principal = session.state, session.principal
        assert state is not None and principal is not None
        return {"namespace": state.id, "tiers": state.store.stats(),
                "tenant": dict(state.counters[principal.tenant])}, b""


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """``(first slot, count)`` of each run of consecutive slot ids, in order."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and slot == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs
