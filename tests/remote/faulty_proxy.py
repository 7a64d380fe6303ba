"""A TCP proxy in front of Redis that breaks the network on demand: the remote tier's bad network.

``FaultyProxy(upstreams, seed)`` listens on one loopback port per upstream node
(``ports[i]`` forwards to ``upstreams[i]``) and copies bytes both ways, chunk by chunk, on an
asyncio loop of its own thread. ``set(Faults(...))`` switches faults at run time, from any
thread; each fault hits a chunk with its probability, drawn from one RNG seeded at start:

- ``latency_s``: a reply chunk waits this long before it is sent (with probability ``slow``);
- ``drop``: a request is swallowed, and so is everything after it on that connection, both
  ways: the connection stays open and the client waits for a reply that never comes;
- ``truncate``: a reply chunk is cut at a random byte, and the connection closed (FIN);
- ``reset``: the same, closed with a RST (``SO_LINGER`` 0), mid-reply;
- ``corrupt``: one byte of a chunk, request or reply, gets flipped bits (a SET's value then
  reaches Redis corrupt, to be read back later);
- ``mix``: a reply chunk is replaced by the last chunk of the same length another connection
  received (one client gets another's reply, e.g. another key's value, its framing intact).

``counts()`` says how often each fault was applied (and ``connections`` accepted).
``close()`` stops the listeners, cuts every connection and ends the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import random
import socket
import struct
import threading
from collections import deque
from dataclasses import dataclass, fields

CHUNK_BYTES = 1 << 18  # the most one read takes off a socket: a chunk
RECENT_REPLIES = 64  # reply chunks remembered for ``mix``
FAULT_KINDS = ("latency", "drop", "truncate", "reset", "corrupt", "mix")

Upstream = tuple[str, int]


@dataclass(frozen=True)
class Faults:
    """What the network does now. Each field but ``latency_s`` is a probability per chunk."""

    latency_s: float = 0.0
    slow: float = 1.0  # probability a reply chunk waits latency_s
    drop: float = 0.0
    truncate: float = 0.0
    reset: float = 0.0
    corrupt: float = 0.0
    mix: float = 0.0

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "latency_s" and not 0.0 <= value <= 1.0:
                raise ValueError(f"{f.name} is a probability, got {value}")


class _Link:
    """One client connection and its upstream: its id and whether it was black-holed."""

    def __init__(self, link_id: int) -> None:
        self.id = link_id
        self.swallowed = False


class FaultyProxy:
    """Thread-safe: ``set``, ``counts`` and ``close`` may be called from any thread.

    Args:
        upstreams: (host, port) of each node; a listener is opened for each.
        seed: the RNG's seed (the faults drawn, given the same chunks, are the same).
        host: where the listeners bind.
    """

    def __init__(self, upstreams: list[Upstream], seed: int = 0, host: str = "127.0.0.1") -> None:
        self.upstreams, self.host = list(upstreams), host
        self.ports: list[int] = []
        self._faults = Faults()  # replaced whole by set(): the loop reads one consistent value
        self._rng = random.Random(seed)  # drawn from on the loop's thread only
        self._lock = threading.Lock()  # the counts
        self._counts = dict.fromkeys(("connections", *FAULT_KINDS), 0)
        self._ids = itertools.count()
        self._recent: deque[tuple[int, bytes]] = deque(maxlen=RECENT_REPLIES)
        self._handlers: set[asyncio.Task[None]] = set()
        self._transports: set[asyncio.WriteTransport] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="faulty-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            self.close()
            raise RuntimeError(f"the proxy did not start: {self._error!r}")

    # ----------------------------------------------------------------------------- control

    def set(self, faults: Faults) -> None:
        """From now on, chunks meet ``faults`` (connections already open too)."""
        self._faults = faults

    def counts(self) -> dict[str, int]:
        """Faults applied so far, by kind, and ``connections`` accepted."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        """Stop listening, cut every connection, end the thread (idempotent)."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop ended already
                loop.call_soon_threadsafe(stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the proxy's thread did not end"

    def __enter__(self) -> FaultyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- the loop

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:
            self._error = e
        finally:
            self._ready.set()  # a start that failed must not leave __init__ waiting

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        servers = []
        try:
            for upstream in self.upstreams:
                server = await asyncio.start_server(functools.partial(self._handle, upstream), self.host, 0)
                servers.append(server)
                self.ports.append(server.sockets[0].getsockname()[1])
            self._ready.set()
            await self._stop.wait()
        finally:
            for server in servers:
                server.close()
            for task in list(self._handlers):
                task.cancel()
            await asyncio.gather(*self._handlers, return_exceptions=True)
            for transport in list(self._transports):
                transport.abort()
            for server in servers:
                await server.wait_closed()
            await asyncio.sleep(0)  # the aborted transports' connection_lost callbacks close their sockets

    async def _handle(self, upstream: Upstream, client_reader: asyncio.StreamReader,
                      client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._count("connections")
        self._transports.add(client_writer.transport)
        upstream_writer: asyncio.StreamWriter | None = None
        pumps: list[asyncio.Task[None]] = []
        try:
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(*upstream)
            except OSError:
                return  # the node is down: the client sees the connection close
            self._transports.add(upstream_writer.transport)
            link = _Link(next(self._ids))
            pumps = [asyncio.ensure_future(self._requests(link, client_reader, upstream_writer)),
                     asyncio.ensure_future(self._replies(link, upstream_reader, client_writer))]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # close() cuts this connection; ending quietly spares asyncio a traceback of it
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    writer.close()
                    self._transports.discard(writer.transport)
            self._handlers.discard(task)

    async def _requests(self, link: _Link, reader: asyncio.StreamReader, upstream: asyncio.StreamWriter) -> None:
        while data := await reader.read(CHUNK_BYTES):
            faults = self._faults
            if link.swallowed:
                continue
            if self._chance(faults.drop):
                link.swallowed = True
                self._count("drop")
                continue
            if self._chance(faults.corrupt):
                data = self._flip(data)
            upstream.write(data)
            await upstream.drain()

    async def _replies(self, link: _Link, reader: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        while data := await reader.read(CHUNK_BYTES):
            faults = self._faults
            if link.swallowed:
                continue
            for kind in ("reset", "truncate"):
                if self._chance(getattr(faults, kind)):
                    self._count(kind)
                    client.write(data[: self._rng.randrange(len(data))])
                    await client.drain()
                    if kind == "reset":  # close with a RST: linger on, for 0 seconds
                        sock = client.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        client.transport.abort()
                    return
            sent = data
            if self._chance(faults.mix):
                other = next((chunk for i, chunk in reversed(self._recent) if i != link.id and len(chunk) == len(data)),
                             None)
                if other is not None:
                    self._count("mix")
                    sent = other
            self._recent.append((link.id, data))
            if self._chance(faults.corrupt):
                sent = self._flip(sent)
            if faults.latency_s > 0 and self._chance(faults.slow):
                self._count("latency")
                await asyncio.sleep(faults.latency_s)  # the fault itself: this chunk is late
            client.write(sent)
            await client.drain()

    # ----------------------------------------------------------------------------- faults

    def _chance(self, probability: float) -> bool:
        return probability > 0 and self._rng.random() < probability

    def _flip(self, data: bytes) -> bytes:
        self._count("corrupt")
        out = bytearray(data)
        out[self._rng.randrange(len(out))] ^= self._rng.randrange(1, 256)
        return bytes(out)

    def _count(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] += 1
