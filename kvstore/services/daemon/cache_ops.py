"""The block protocol's cache-management ops (docs/protocol.md, "Managing the cache").

``pin`` (with ``ttl_s``), ``unpin`` and ``delete`` (with ``descendants``) are ``Ops``'
own; these are the rest: ``prefetch`` and ``prefetch_status``, ``inspect``, ``forget``. Each
acts on the connection's tenant; the admin token may name another with ``tenant``
(kvstore/services/daemon/tenant_admin.py). A connection's prefetches are its own: at most
``MAX_PREFETCHES`` not yet done (of those done and never asked about, the oldest are
dropped past four times that), and they end with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore.protocol import Code, ProtocolError, field_of, split_keys
from kvstore.results import PrefetchHandle
from kvstore.services.daemon.registry import NamespaceState, Registry
from kvstore.services.daemon.tenant_admin import NotAllowed, UnknownTenant, acting_tenant, forget_everywhere

if TYPE_CHECKING:
    from kvstore.services.daemon.ops import Reply, Session

MAX_PREFETCHES = 64  # a connection's prefetches not yet reported done
MAX_STATUS_WAIT_S = 5.0  # the longest a prefetch_status waits for its prefetch
_PREFETCHES = threading.Lock()  # a connection's requests run on several workers at once


class CacheOps:
    """Mixed into ``Ops`` (which has ``registry`` and ``max_keys``)."""

    registry: Registry
    max_keys: Callable[[NamespaceState], int]  # Ops'

    def _tenant(self, session: Session, meta: dict[str, Any]) -> str:
        """The tenant this request acts on: the connection's, or (admin) the one it names."""
        assert session.principal is not None
        asked = field_of(meta, "tenant", str, None)
        try:
            return acting_tenant(self.registry, session.principal, asked)
        except NotAllowed as exc:
            raise ProtocolError(Code.AUTH, str(exc)) from None
        except UnknownTenant as exc:
            raise ProtocolError(Code.NOT_FOUND, str(exc)) from None

    def _managed_keys(self, session: Session, meta: dict[str, Any]) -> tuple[NamespaceState, str, list[bytes]]:
        """``Ops._keys`` for a management op: the keys scoped as the acting tenant's."""
        state = session.state
        assert state is not None
        tenant = self._tenant(session, meta)
        keys = split_keys(field_of(meta, "keys", bytes), state.store.hasher.key_bytes)
        if len(keys) > self.max_keys(state):
            raise ProtocolError(Code.BAD_REQUEST, f"{len(keys)} keys in one request, the limit is "
                                f"{self.max_keys(state)}")
        return state, tenant, state.scope(tenant, keys)

    def op_prefetch(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        state, tenant, keys = self._managed_keys(session, meta)
        with _PREFETCHES:
            pending = sum(1 for h in session.prefetches.values() if not h.done())
            if pending >= MAX_PREFETCHES:
                raise ProtocolError(Code.CAPACITY, f"{pending} prefetches of this connection are not done, the "
                                    f"limit is {MAX_PREFETCHES}")
            if len(session.prefetches) >= 4 * MAX_PREFETCHES:  # done, never asked about: the oldest go
                for old in [i for i, h in session.prefetches.items() if h.done()][:MAX_PREFETCHES]:
                    del session.prefetches[old]
            handle = state.store.prefetch(keys)
            session.num_prefetches += 1
            prefetch_id = session.num_prefetches
            session.prefetches[prefetch_id] = handle
        state.count(tenant, requests=1)
        return {"prefetch": prefetch_id, "num_keys": len(keys)}, b""

    def op_prefetch_status(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        prefetch_id = field_of(meta, "prefetch", int)
        wait_s = field_of(meta, "wait_s", (int, float), 0.0)
        if not 0 <= wait_s <= MAX_STATUS_WAIT_S:
            raise ProtocolError(Code.BAD_REQUEST, f"wait_s must be in [0, {MAX_STATUS_WAIT_S}], got {wait_s!r}")
        with _PREFETCHES:
            handle: PrefetchHandle | None = session.prefetches.get(prefetch_id)
        if handle is None:
            raise ProtocolError(Code.NOT_FOUND, f"no prefetch {prefetch_id} on this connection (unknown, or "
                                "reported done already)")
        deadline = time.monotonic() + wait_s
        done = handle.wait(max(0.0, deadline - time.monotonic()))
        if not done:
            return {"done": False, "num_blocks": 0}, b""
        with _PREFETCHES:
            session.prefetches.pop(prefetch_id, None)
        return {"done": True, "num_blocks": handle.result()}, b""

    def op_inspect(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        state, tenant, keys = self._managed_keys(session, meta)
        state.count(tenant, requests=1)
        blocks: list[dict[str, Any] | None] = []
        for info in state.store.inspect(keys):
            if info is None:
                blocks.append(None)
                continue
            row = info.as_dict()
            del row["key"]  # the key as filed (scoped): the client knows the one it sent
            blocks.append(row)
        return {"blocks": blocks}, b""

    def op_forget(self, session: Session, meta: dict[str, Any], data: bytes) -> Reply:
        """Forget a tenant in every namespace of the daemon: the connection's own, or (admin)
        the one named, which the admin must name (its own tenant is rarely meant)."""
        principal = session.principal
        assert principal is not None
        if principal.admin and "tenant" not in meta:
            raise ProtocolError(Code.BAD_REQUEST, "the admin token must name the tenant to forget ('tenant')")
        tenant = self._tenant(session, meta)
        report = forget_everywhere(self.registry, tenant)
        return report, b""
