"""What every block-protocol handler is given and shares: the handler's shape, the daemon's
parts it may use (``OpContext``), and the limits of one request.

A handler is ``handler(ctx, session, meta, data) -> (meta, data)``: the request's meta map and
raw data in, the response's out; it raises (a ProtocolError, a store error) to fail, and
kvstore/services/daemon/dispatch.py maps what it raises to an error code. The handler
modules (block_ops, shm_ops, manage_ops) each export their ``HANDLERS`` table and import
none of each other; they share what is here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.client.pool_map import MappedPool
from kvstore.protocol import Code, ProtocolError, field_of, split_keys
from kvstore.services.daemon.config import DaemonConfig
from kvstore.services.daemon.registry import NamespaceState, Registry
from kvstore.services.daemon.session import Session
from kvstore.services.daemon.shm import Leases

MAX_KEYS = 1 << 16  # keys in one request (fewer where they would not fit a frame: OpContext.max_keys)
REQUEST_ROOM = 1 << 10  # bytes of a frame kept for a request's fields besides its keys and blocks

Reply = tuple[dict[str, Any], Any]  # the response's meta map and its data (bytes-like, or HeldBlocks)
# A handler that may wait (on the store lock, on a disk): it runs on a worker thread.
Handler = Callable[["OpContext", Session, dict[str, Any], Any], Reply]
# A handler the event loop may run itself: None when it would wait (nothing was done then).
NowHandler = Callable[["OpContext", Session, dict[str, Any], Any], "Reply | None"]


class MappedPools:
    """This process's mapping of each namespace's shared host pool, made on first use and
    kept for the daemon's life (socket puts are received into its slots, gets written from
    them). Thread-safe."""

    def __init__(self) -> None:
        self._pools: dict[str, MappedPool] = {}  # namespace id -> its host pool, mapped
        self._lock = threading.Lock()

    def get(self, namespace: str, pool: tuple[str, int, int]) -> MappedPool:
        """The mapping of ``pool`` (path, slot_bytes, num_slots) of ``namespace``."""
        with self._lock:
            if namespace not in self._pools:
                self._pools[namespace] = MappedPool(*pool)
            return self._pools[namespace]


@dataclass
class OpContext:
    """The daemon's parts a handler may use: its config, its namespaces and tokens, its
    shared-memory leases, and its mappings of the host pools."""

    config: DaemonConfig
    registry: Registry
    leases: Leases
    pools: MappedPools = field(default_factory=MappedPools)

    def max_keys(self, state: NamespaceState) -> int:
        """Keys one request may carry: ``MAX_KEYS``, or fewer where they would not fit a frame."""
        return min(MAX_KEYS, (self.config.max_frame - REQUEST_ROOM) // state.store.hasher.key_bytes)

    def max_blocks(self, state: NamespaceState) -> int:
        """Blocks one put or get may carry: each with its key in the request and its bytes in
        the frame (hello made sure that one fits)."""
        per_block = state.layout.bytes_per_block + state.store.hasher.key_bytes
        return max(1, min(self.max_keys(state), (self.config.max_frame - REQUEST_ROOM) // per_block))

    def check_batch(self, state: NamespaceState, n: int) -> None:
        """BAD_REQUEST when ``n`` blocks would not fit one frame."""
        if n > self.max_blocks(state):
            raise ProtocolError(Code.BAD_REQUEST, f"{n} blocks in one request, at most {self.max_blocks(state)} "
                                f"fit a {self.config.max_frame}-byte frame")

    def scoped_keys(self, state: NamespaceState, tenant: str, meta: dict[str, Any]) -> list[bytes]:
        """The request's ``keys``, split and checked against ``max_keys``, scoped as ``tenant``'s."""
        keys = split_keys(field_of(meta, "keys", bytes), state.store.hasher.key_bytes)
        if len(keys) > self.max_keys(state):
            raise ProtocolError(Code.BAD_REQUEST, f"{len(keys)} keys in one request, the limit is {self.max_keys(state)}")
        return state.scope(tenant, keys)

    def request_group(self, state: NamespaceState, meta: dict[str, Any]) -> int | None:
        """A put's or commit's ``group``: the KV group its blocks are of (None: not said)."""
        group = field_of(meta, "group", (int, type(None)), None)
        if group is not None and (isinstance(group, bool) or not 0 <= group < state.layout.num_groups):
            raise ProtocolError(Code.BAD_REQUEST, f"group {group!r} is not one of the namespace's "
                                f"{state.layout.num_groups} KV groups")
        return group

    def request_keys(self, session: Session, meta: dict[str, Any]) -> tuple[NamespaceState, str, list[bytes]]:
        """The session's namespace and tenant, and the request's keys scoped as that tenant's."""
        state, principal = session.state, session.principal
        assert state is not None and principal is not None  # the dispatcher runs no op before hello
        return state, principal.tenant, self.scoped_keys(state, principal.tenant, meta)
