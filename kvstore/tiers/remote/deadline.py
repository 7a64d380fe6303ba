"""A per-call deadline under redis-py: no connect, send or receive of a call outlives it.

redis-py bounds each socket operation by ``socket_timeout``, not a call. A node that trickles
its reply (one byte every 0.3 s) satisfies every single receive in time and holds a pipeline
for as long as it likes. So each connection's socket is wrapped here: within ``deadline(at)``
every receive and send of the calling thread waits at most until ``at`` and then fails with
``socket.timeout``, which redis-py reports as its TimeoutError (and disconnects: a reply cut
off halfway leaves no stray bytes behind). Outside ``deadline`` the socket behaves exactly as
redis-py configured it. Deadlines are per thread because a pipeline runs on one thread and
holds its connection for the whole call.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from redis.connection import Connection, SSLConnection

_local = threading.local()


@contextlib.contextmanager
def deadline(at: float) -> Iterator[None]:
    """Within: this thread's Redis calls end by ``at`` (``time.monotonic()``); nested: the
    earlier deadline holds."""
    outer: float | None = getattr(_local, "at", None)
    _local.at = at if outer is None else min(at, outer)
    try:
        yield
    finally:
        _local.at = outer


def current_deadline() -> float | None:
    """This thread's deadline (``time.monotonic()``), or None outside ``deadline``."""
    return getattr(_local, "at", None)


def _bounded(timeout: float | None) -> float | None:
    """``timeout`` cut to what is left of this thread's deadline; raises once it passed."""
    at: float | None = getattr(_local, "at", None)
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        raise TimeoutError("the call's deadline passed")  # socket.timeout, as redis-py expects
    return left if timeout is None else min(timeout, left)


class _DeadlineSocket:
    """A connected socket whose receives and sends end by the thread's deadline; everything
    else goes to the socket itself. ``settimeout`` keeps redis-py's own timeout, which each
    operation then cuts to the time left."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def recv(self, size: int, flags: int = 0) -> bytes:
        self._sock.settimeout(_bounded(self._timeout))
        return self._sock.recv(size, flags)

    def recv_into(self, buffer: Any, size: int = 0, flags: int = 0) -> int:
        self._sock.settimeout(_bounded(self._timeout))
        return self._sock.recv_into(buffer, size, flags)

    def sendall(self, data: Any, flags: int = 0) -> None:
        self._sock.settimeout(_bounded(self._timeout))  # a sendall's timeout bounds all of it
        self._sock.sendall(data, flags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _connect(connection: Connection, connect: Callable[[], socket.socket]) -> _DeadlineSocket:
    base = connection.socket_connect_timeout
    connection.socket_connect_timeout = _bounded(base)
    try:
        return _DeadlineSocket(connect())
    except ValueError as exc:  # a host name IDNA refuses ("a..b"), as a MOVED, ASK or CLUSTER SLOTS may name
        raise OSError(f"cannot resolve host {connection.host!r}: {exc}") from None  # redis-py: ConnectionError
    finally:
        connection.socket_connect_timeout = base


class DeadlineConnection(Connection):
    """redis-py's TCP connection, bounded by the calling thread's ``deadline``."""

    def _connect(self) -> Any:
        return _connect(self, super()._connect)


class DeadlineSSLConnection(SSLConnection):
    """redis-py's TLS connection, bounded by the calling thread's ``deadline`` (the TLS
    handshake itself by ``socket_timeout``)."""

    def _connect(self) -> Any:
        return _connect(self, super()._connect)


def socket_of(connection: Connection) -> _DeadlineSocket:
    """The connected socket of one of our connections (the deadline-bounded one), for a
    reader that takes replies off it itself (tiers.remote.replies)."""
    sock = connection._sock
    assert isinstance(sock, _DeadlineSocket), f"not a deadline-bounded connection: {type(connection).__name__}"
    return sock
