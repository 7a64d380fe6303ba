"""A daemon's address: the ``unix://PATH`` and ``tcp://HOST:PORT`` forms, and a socket connected to one.

A connection that fails raises the ``OSError`` it got, of its own type (``FileNotFoundError``,
``ConnectionRefusedError``...) and a ``DaemonUnreachableError`` too, so a caller may catch
either; its message names the address and the path or host:port tried.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from kvstore.errors import DaemonUnreachableError

SOCKET_BUFFER_BYTES = 4 << 20  # send and receive buffers: a block's frame goes out in few syscalls

_UNREACHABLE: dict[type[OSError], type[OSError]] = {}  # OSError subclass -> it and DaemonUnreachableError


def parse_address(url: str) -> tuple[str, Any]:
    """``("unix", path)`` or ``("tcp", (host, port))`` of a daemon address.

    Everything after ``unix://`` is the socket's path, so ``unix:///abs/kv.sock`` is absolute
    and ``unix://.kvstore/kvstore.sock`` is relative to the working directory.

    Raises:
        ValueError: ``url`` is neither form (or not a str).
    """
    if not isinstance(url, str):
        raise ValueError(f"url must be a str, got {type(url).__name__}")
    if url.startswith("unix://") and len(url) > len("unix://"):
        return "unix", url[len("unix://") :]
    if url.startswith("tcp://"):
        host, _, port = url[len("tcp://") :].rstrip("/").rpartition(":")
        host = host.strip("[]")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return "tcp", (host, int(port))
    raise ValueError(f"url must be unix://PATH (absolute or relative) or tcp://HOST:PORT, got {url!r}")


def open_socket(url: str, timeout: float) -> socket.socket:
    """A stream socket connected to the daemon at ``url``, ``timeout`` seconds per operation.

    Raises:
        ValueError: ``url`` is neither form.
        OSError: nothing listens at ``url`` (a ``DaemonUnreachableError`` as well).
    """
    kind, address = parse_address(url)
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        try:
            sock = socket.create_connection(address, timeout=timeout)
        except OSError as exc:
            raise _unreachable(exc, url, f"{address[0]}:{address[1]}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
    if kind == "unix":
        try:
            sock.connect(address)
        except OSError as exc:
            sock.close()
            raise _unreachable(exc, url, f"the socket {os.path.abspath(address)}") from None
    return sock


def _unreachable(exc: OSError, url: str, tried: str) -> OSError:
    """``exc`` again, naming what was tried: of its own type and a ``DaemonUnreachableError``."""
    kind = _UNREACHABLE.get(type(exc))
    if kind is None:
        kind = _UNREACHABLE[type(exc)] = type(type(exc).__name__, (type(exc), DaemonUnreachableError), {})
    message = f"no kvstore daemon answers at {url!r} (tried {tried}): {exc.strerror or exc}; " \
              "is `kvstore serve` running?"
    return kind(exc.errno, message) if exc.errno is not None else kind(message)
