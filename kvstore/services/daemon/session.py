"""One block-protocol connection's session: who is asking, in which namespace, what it holds.

``hello`` sets the principal and the namespace; every later op reads them. A session also owns
its prefetches (``prefetch``, ``prefetch_status``): at most ``MAX_PREFETCHES`` not yet done,
and of those done and never asked about, the oldest are dropped past four times that. Its
pins are held as ``holder=conn_id`` and its shared-memory leases carry ``conn_id``
(kvstore/services/daemon/shm.py): both end with the connection (``Daemon.end_session``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.errors import KVStoreError
from kvstore.protocol import Code, ProtocolError
from kvstore.results import PrefetchHandle
from kvstore.services.common.tokens import Principal
from kvstore.services.daemon.registry import NamespaceState

MAX_PREFETCHES = 64  # a connection's prefetches not yet reported done
log = logging.getLogger("kvstore.services.daemon")


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
    # A connection's requests run on several workers at once: its prefetches change under this.
    _prefetch_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_prefetch(self, start: Callable[[], PrefetchHandle]) -> int:
        """Start a prefetch (``start()``) and file it under a new id, which is returned.

        Raises:
            ProtocolError: CAPACITY, ``MAX_PREFETCHES`` of this connection are not done
                (nothing is started then).
        """
        with self._prefetch_lock:
            pending = sum(1 for h in self.prefetches.values() if not h.done())
            if pending >= MAX_PREFETCHES:
                raise ProtocolError(Code.CAPACITY, f"{pending} prefetches of this connection are not done, the "
                                    f"limit is {MAX_PREFETCHES}")
            if len(self.prefetches) >= 4 * MAX_PREFETCHES:  # done, never asked about: the oldest go
                for old in [i for i, h in self.prefetches.items() if h.done()][:MAX_PREFETCHES]:
                    del self.prefetches[old]
            handle = start()
            self.num_prefetches += 1
            self.prefetches[self.num_prefetches] = handle
            return self.num_prefetches

    def prefetch(self, prefetch_id: int) -> PrefetchHandle | None:
        """A prefetch not yet reported done; None if unknown."""
        with self._prefetch_lock:
            return self.prefetches.get(prefetch_id)

    def drop_prefetch(self, prefetch_id: int) -> None:
        """Forget a prefetch once it was reported done."""
        with self._prefetch_lock:
            self.prefetches.pop(prefetch_id, None)

    def unpin_all(self) -> None:
        """A connection's pins end with it (its pins are held as ``holder=conn_id``, TTL or
        not): a dead client cannot pin blocks forever. Its prefetches are dropped."""
        with self._prefetch_lock:
            self.prefetches.clear()
        if self.state is not None:
            try:
                self.state.store.end_pins(self.conn_id)
            except KVStoreError:
                log.warning("could not end the pins of closed connection %d", self.conn_id)
