"""What kvstore's long-running servers share (``kvstore serve``, ``kvstore engine``,
``kvstore route``): the listening socket, a uvicorn server that leaves signals to its owner,
the signal rule (the first SIGTERM/SIGINT starts the drain, a second one exits at once), and
the heap freeze once started.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
from collections.abc import Iterator
from typing import Any

from kvstore.errors import ConfigError


def bind(host: str, port: int) -> socket.socket:
    """The listening socket. Raises ConfigError when the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that name it, and
    # without it Nagle holds each SSE chunk back until the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def freeze_start_heap() -> None:
    """Exempt what the process built to start (modules, torch, a model, a store) from the
    cyclic garbage collector's later full passes. A full pass walks every tracked object: some
    170,000 in a daemon just started, 88 ms on a 2-core VM, during which the event loop serves
    no one; with them frozen it walks only what was made since (index entries, leases).
    Call it once, when the server is ready."""
    gc.collect()
    gc.freeze()


def stop_on_signals(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """An event set by the first SIGTERM/SIGINT; a second signal exits the process at once."""
    stop = asyncio.Event()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            os._exit(1)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    return stop


def uvicorn_server(app: Any) -> Any:
    """A quiet uvicorn server for ``app`` whose owner handles the signals (see stop_on_signals)."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return _Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                  timeout_graceful_shutdown=1))


def where(sock: socket.socket) -> str:
    """``host:port`` of a bound socket (``[host]:port`` for IPv6)."""
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
