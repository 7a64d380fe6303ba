"""Shared-memory leases: a same-host client copies blocks straight from/to the host pool.

A read lease holds blocks in host RAM (``HostLeases.acquire``) while the client copies
their slots out; ``release`` tells the client whether the lease was still valid when it
finished (if not, it discards what it copied). A write lease is a set of reserved free slots
(``HostLeases.reserve``) the client fills; ``commit`` publishes them. Leases expire after
``lease_s``: an expired read lease is released at once; an expired write lease's slots are
quarantined for one more ``lease_s`` before they are reused, so a slow client that still
writes cannot overwrite a published block (the client never starts a copy past its deadline).
A closed connection ends all its leases, so a dead client cannot hold memory.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import overload

from kvstore.protocol import Code, ProtocolError
from kvstore.services.daemon.registry import NamespaceState

# Write leases a client may keep besides those of its requests in flight: the Python client
# keeps up to two reserved ahead for its next puts, and one more is live while its last put's
# commit is on its way.
STANDING_WRITE_LEASES = 3


def leases_per_connection(max_inflight: int) -> int:
    """The most leases one connection may hold: one for each request in flight and for each
    release still on its way, plus ``STANDING_WRITE_LEASES``."""
    return 2 * max_inflight + STANDING_WRITE_LEASES


@dataclass
class Lease:
    id: int
    kind: str  # "read" or "write"
    conn: int
    state: NamespaceState
    keys: list[bytes]  # stored (tenant-scoped) keys
    slots: list[int]
    tenant: str
    deadline: float


class Leases:
    """Every live lease of the daemon. Thread-safe; store calls happen outside its lock.

    A connection holds at most ``max_per_conn`` live leases: a client that takes leases and
    never commits or releases them is refused (``Code.LEASE``) before it can pin host RAM.
    """

    def __init__(self, lease_s: float, max_per_conn: int) -> None:
        self.lease_s = lease_s
        self.max_per_conn = max_per_conn
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._live: dict[int, Lease] = {}
        self._held: Counter[int] = Counter()  # connection -> its live leases and grants under way
        self._quarantine: list[Lease] = []
        self.num_expired = 0

    def _claim(self, conn: int) -> None:
        """Count a grant under way against the connection's limit (checked and counted in
        one step, so requests of one connection running on several threads cannot pass it)."""
        with self._lock:
            held = self._held[conn]
            if held >= self.max_per_conn:
                raise ProtocolError(Code.LEASE, f"connection holds {held} leases, the limit is {self.max_per_conn}; "
                                    "release or commit some first")
            self._held[conn] = held + 1

    def _unclaim_locked(self, conn: int) -> None:
        self._held[conn] -= 1
        if self._held[conn] <= 0:
            del self._held[conn]

    def _unclaim(self, conn: int) -> None:
        with self._lock:
            self._unclaim_locked(conn)

    def _add(self, lease: Lease) -> Lease:
        """Make a claimed grant live."""
        with self._lock:
            self._live[lease.id] = lease
        return lease

    def grant_read(self, conn: int, state: NamespaceState, keys: list[bytes], tenant: str) -> Lease:
        """Hold the leading run of ``keys`` that is (or can be brought) in host RAM."""
        self._claim(conn)
        try:
            slots = state.store.host_leases.acquire(keys)
        except BaseException:
            self._unclaim(conn)
            raise
        lease = Lease(next(self._ids), "read", conn, state, keys[: len(slots)], slots, tenant,
                      time.monotonic() + self.lease_s)
        return self._add(lease)

    @overload
    def grant_write(self, conn: int, state: NamespaceState, keys: list[bytes], tenant: str,
                    evict: bool = True) -> Lease: ...
    @overload
    def grant_write(self, conn: int, state: NamespaceState, keys: list[bytes], tenant: str,
                    evict: bool = True, *, blocking: bool) -> Lease | None: ...

    def grant_write(self, conn: int, state: NamespaceState, keys: list[bytes], tenant: str,
                    evict: bool = True, *, blocking: bool = True) -> Lease | None:
        """Reserve one free host slot per key (CapacityError when none can be freed; with
        ``evict=False``, when fewer are free). Without ``blocking``: None instead of waiting
        for the store lock (see HostLeases.reserve)."""
        self._claim(conn)
        try:
            slots = state.store.host_leases.reserve(len(keys), evict=evict, blocking=blocking)
        except BaseException:
            self._unclaim(conn)
            raise
        if slots is None:
            self._unclaim(conn)
            return None
        lease = Lease(next(self._ids), "write", conn, state, keys, slots, tenant, time.monotonic() + self.lease_s)
        return self._add(lease)

    def put_back(self, lease: Lease) -> None:
        """Make a lease ``take`` returned live again (nothing was done with it)."""
        with self._lock:
            self._live[lease.id] = lease
            self._held[lease.conn] += 1

    def take(self, conn: int, lease_id: int, kind: str) -> Lease | None:
        """Remove and return a live lease of this connection; None if unknown or expired."""
        with self._lock:
            lease = self._live.get(lease_id)
            if lease is None or lease.conn != conn or lease.kind != kind:
                return None
            if time.monotonic() > lease.deadline:
                return None  # expire() releases it
            self._unclaim_locked(conn)
            return self._live.pop(lease_id)

    def expire(self, now: float | None = None) -> int:
        """Release expired read leases; quarantine, then free, expired write leases."""
        now = time.monotonic() if now is None else now
        with self._lock:
            dead = [lease for lease in self._live.values() if now > lease.deadline]
            for lease in dead:
                del self._live[lease.id]
                self._unclaim_locked(lease.conn)
            free = [lease for lease in self._quarantine if now > lease.deadline + self.lease_s]
            self._quarantine = [lease for lease in self._quarantine if now <= lease.deadline + self.lease_s]
            self._quarantine += [lease for lease in dead if lease.kind == "write"]
            self.num_expired += len(dead)
        for lease in dead:
            if lease.kind == "read":
                lease.state.store.host_leases.release(lease.keys)
        for lease in free:
            lease.state.store.host_leases.cancel(lease.slots)
        return len(dead)

    def drop_connection(self, conn: int) -> None:
        """End every lease of a closed connection (its process can no longer write)."""
        with self._lock:
            mine = [lease for lease in self._live.values() if lease.conn == conn]
            mine += [lease for lease in self._quarantine if lease.conn == conn]
            for lease in mine:
                self._live.pop(lease.id, None)
            self._held.pop(conn, None)
            self._quarantine = [lease for lease in self._quarantine if lease.conn != conn]
        for lease in mine:
            if lease.kind == "read":
                lease.state.store.host_leases.release(lease.keys)
            else:
                lease.state.store.host_leases.cancel(lease.slots)

    def __len__(self) -> int:
        with self._lock:
            return len(self._live) + len(self._quarantine)
