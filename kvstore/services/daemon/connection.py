"""One block-protocol connection, on asyncio's BufferedProtocol: frames are received in place.

Receiving is frames.py's ``FrameReader``: a put's data section lands straight in the
host-pool slots the store reserved for its blocks (the op then only publishes them), any
other in one buffer of exactly ``data_len`` bytes. So a socket put's block bytes are copied
once, by the kernel, into the host tier. Sending is replies.py's ``ReplyWriter``: a get of
blocks all in host RAM is written straight from their slots (``HeldBlocks``). Large data
sections, either way, are moved in a tight loop while the peer keeps pace (bulk_io.py).

Dispatch: a request that waits on nothing (``Dispatcher.handle_now``: a commit that stays in
memory and finds the store lock free) is served and answered on the loop, with no task;
every other request gets a task, which runs it on a worker.

Back-pressure: a frame takes one of ``max_inflight`` slots when its header is parsed and
gives it back once the transport took its reply below the write high-water mark; no header
is parsed while all slots are taken (nor while a hello runs, a put's slots are being
reserved, or a get's held blocks are being released on a worker), and reading pauses then.
So one connection buffers the staging area plus at most ``max_inflight`` frames and replies,
each at most ``max_frame`` bytes.

The daemon that accepted it is a ``ConnectionHost`` (limits, dispatcher, workers, the hooks
that count connections and requests): this module does not import the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from concurrent.futures import Executor
from typing import Any, Protocol

from kvstore.protocol import Code, ProtocolError, encode
from kvstore.services.daemon.config import DaemonConfig
from kvstore.services.daemon.dispatch import Data, Dispatcher
from kvstore.services.daemon.frames import DATA, HEAD, META, FrameReader
from kvstore.services.daemon.host_slots import HeldBlocks, ReservedPut
from kvstore.services.daemon.replies import ReplyWriter
from kvstore.services.daemon.session import Session

SOCKET_BUFFER = 4 << 20


class ConnectionHost(Protocol):
    """What a connection needs of the daemon that accepted it (``server.Daemon`` is one)."""

    num_inflight: int  # requests being served, on every connection

    @property
    def config(self) -> DaemonConfig: ...
    @property
    def ops(self) -> Dispatcher: ...
    @property
    def pool(self) -> Executor: ...  # the workers that run store calls
    @property
    def num_connections(self) -> int: ...
    @property
    def is_stopping(self) -> bool: ...
    def next_conn_id(self) -> int: ...
    def connection_opened(self, conn: Connection) -> None: ...
    async def connection_closed(self, conn: Connection) -> None: ...
    async def end_session(self, conn: Connection) -> None: ...
    def track(self, task: asyncio.Task[None]) -> None: ...


class Connection(asyncio.BufferedProtocol):
    """One client's connection: its session, its frames in, its replies out."""

    def __init__(self, daemon: ConnectionHost, kind: str) -> None:
        self.daemon = daemon
        self.kind = kind  # "unix" or "tcp"
        self.session = Session(0, kind)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._counted = False  # accepted (not refused as busy or draining)
        self._frames = FrameReader(daemon.config.max_frame)
        self._replies = ReplyWriter(daemon.config.max_frame)
        self._num_slots = 0  # frames parsed whose replies have not drained yet
        self._exclusive = False  # a hello runs: nothing runs beside it
        self._reserving = False  # a put's slots are being reserved
        self._releasing = 0  # gets' held blocks being released on a worker: no new frames
        self._stopped = False  # the daemon drains, or the stream is out of step: no new frames
        self._eof = False  # the peer sent everything; staged frames are still served
        self._reading = True
        self.tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        d = self.daemon
        if d.is_stopping or d.num_connections >= d.config.max_connections:
            why = "draining" if d.is_stopping else f"{d.num_connections} connections, the limit"
            code = Code.SHUTDOWN if d.is_stopping else Code.BUSY
            transport.write(encode({"id": None, "error": {"code": int(code), "message": why}}))
            transport.close()  # after the error frame is flushed
            self.closed = True
            return
        sock = transport.get_extra_info("socket")
        if self.kind == "tcp":
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        self._frames.fd = sock.fileno()
        self._replies.attach(transport, sock.fileno())
        self._counted = True
        self.session = Session(d.next_conn_id(), self.kind)
        d.connection_opened(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._frames.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        frame = self._frames.received(nbytes)
        if frame is not None:
            self._dispatch(*frame)
        elif self._frames.receiving:  # the rest of a part is still to come
            return
        self._advance()

    def eof_received(self) -> bool:
        # Frames already received are still served and answered; then the connection closes.
        self._eof = True
        self._reading = False  # the transport stopped reading by itself
        self._spawn(self._close_when_idle())
        return True

    def pause_writing(self) -> None:
        self._replies.pause()

    def resume_writing(self) -> None:
        self._replies.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._replies.lost()
        reserved = self._frames.abandon()  # a put whose data never finished arriving
        if not self._counted:
            return
        if reserved is not None:
            self._release_reserved(reserved)
        asyncio.get_running_loop().create_task(self.daemon.connection_closed(self))

    # ------------------------------------------------------------------ framing

    def _advance(self) -> None:
        """Parse what the staging buffer holds, as far as slots and targets allow."""
        frames = self._frames
        while not self.closed and not frames.receiving and not self._reserving:
            if frames.state == HEAD:
                if (self._stopped or self._exclusive or self._releasing
                        or self._num_slots >= self.daemon.config.max_inflight):
                    break
                header = frames.read_header()
                if header is False:
                    break
                self._num_slots += 1
                if isinstance(header, ProtocolError):  # the stream is out of step: reply, then close
                    self._spawn(self._reply_error(header, close=True))
                    self._stopped = True
                    break
            elif frames.state == META:
                if not frames.read_meta():
                    break
            elif frames.state == DATA:
                self._receive_data()
        self._sync_reading()

    def _receive_data(self) -> None:
        """Pick the parsed frame's data target: none, reserved host slots, or a buffer."""
        frames, meta = self._frames, self._frames.meta
        if frames.data_len == 0:
            self._dispatch(*frames.take(b""))
        elif isinstance(meta, dict) and meta.get("op") == "put" and self.session.principal is not None:
            # free slots and a free store lock: taken here, with no hop to a worker
            reserved = self.daemon.ops.reserve_put(self.session, meta, frames.data_len, blocking=False)
            if reserved is not None:
                self._fill(reserved)
            else:
                self._reserving = True
                self._spawn(self._reserve())
        else:
            self._fill(bytearray(frames.data_len))

    def _fill(self, body: bytearray | ReservedPut) -> None:
        frame = self._frames.fill(body)
        if frame is not None:
            self._dispatch(*frame)

    async def _reserve(self) -> None:
        """Ask the store for host slots to receive this put's blocks in; else a plain buffer."""
        loop = asyncio.get_running_loop()
        meta, data_len = self._frames.meta, self._frames.data_len
        assert isinstance(meta, dict)
        try:
            reserved = await loop.run_in_executor(self.daemon.pool, self.daemon.ops.reserve_put, self.session,
                                                  meta, data_len)
        except RuntimeError:  # the pool is shut down
            reserved = None
        self._reserving = False
        if self.closed:
            if reserved is not None:
                self._release_reserved(reserved)
            return
        self._fill(reserved if reserved is not None else bytearray(data_len))
        self._advance()

    def _dispatch(self, meta: dict[str, Any] | ProtocolError, data: Data) -> None:
        if isinstance(meta, ProtocolError):
            self._spawn(self._reply_error(meta, close=False))
        elif not self._serve_now(meta, data):
            self._exclusive = self.session.principal is None  # hello runs alone
            self._spawn(self._serve(meta, data))

    def _serve_now(self, meta: dict[str, Any], data: Data) -> bool:
        """Serve a request that waits on nothing (``Dispatcher.handle_now``) here, reply and all,
        with no task. False: not run (it would wait, or its reply's slot would wait for the
        transport); a task serves it. The caller goes on parsing: no ``_advance`` here."""
        if self._replies.paused:
            return False
        reply = self.daemon.ops.handle_now(self.session, meta, data)
        if reply is None:
            return False
        out, payload = reply
        assert not len(payload), "a commit's reply carries no data"
        if meta.get("noreply") is not True:
            self._replies.write_meta(out)
        if self._replies.paused:  # that reply crossed the high-water mark: its slot waits for it
            self._spawn(self._slot_after_drain())
        else:
            self._num_slots -= 1
        return True

    async def _slot_after_drain(self) -> None:
        try:
            await self._replies.drained()
        except ConnectionError:
            pass
        finally:
            self._slot_done()

    def _sync_reading(self) -> None:
        want = not (self.closed or self._eof or self._reserving
                    or (self._frames.state == HEAD and not self._frames.receiving
                        and (self._stopped or self._exclusive or self._releasing
                             or self._num_slots >= self.daemon.config.max_inflight)))
        if want == self._reading or self.transport is None or self.transport.is_closing():
            return
        self._reading = want
        if want:
            self.transport.resume_reading()
        else:
            self.transport.pause_reading()

    # ------------------------------------------------------------------ requests and replies

    async def _serve(self, meta: dict[str, Any], data: Data) -> None:
        d = self.daemon
        d.num_inflight += 1
        try:
            # a commit that waits on nothing runs here: no two thread hops
            reply = d.ops.handle_now(self.session, meta, data)
            if reply is None:
                reply = await asyncio.get_running_loop().run_in_executor(d.pool, d.ops.handle, self.session,
                                                                         meta, data)
            out, payload = reply
            try:
                if meta.get("noreply") is not True:  # a hint (touch): no reply, not even an error
                    await self._send(out, payload)
            finally:
                if isinstance(payload, HeldBlocks) and not payload.let_go:  # no reply was written
                    self._let_go(payload)
        except (ConnectionError, RuntimeError):
            self.close()
        finally:
            d.num_inflight -= 1
            self._exclusive = False
            self._slot_done()

    async def _reply_error(self, exc: ProtocolError, *, close: bool) -> None:
        self.daemon.ops.errors[exc.code.name] += 1
        try:
            await self._send({"id": None, "error": {"code": int(exc.code), "message": exc.message}}, b"")
        except ConnectionError:
            pass
        finally:
            if close:
                self.close()
            self._slot_done()

    async def _send(self, meta: dict[str, Any], payload: Any) -> None:
        self._replies.write(meta, payload)
        if isinstance(payload, HeldBlocks):  # before any await: released before a later frame is parsed
            self._let_go(payload)
        await self._replies.drained()  # the reply's slot frees only once the transport took it

    def _slot_done(self) -> None:
        self._num_slots -= 1
        if not self.closed:
            self._advance()

    def _let_go(self, held: HeldBlocks) -> None:
        """Release a get's blocks once its reply is written (or copied for the transport): here
        when the store lock is free, else on a worker, and no further frame is parsed until
        then (the client's next request, say a delete of those blocks, must find them released)."""
        held.let_go = True
        if not held.release(blocking=False):
            self._releasing += 1
            self._spawn(self._release_on_worker(held))

    async def _release_on_worker(self, held: HeldBlocks) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self.daemon.pool, held.release)
        except RuntimeError:  # the pool is shut down: so are the stores
            pass
        finally:
            self._releasing -= 1
            if not self.closed:
                self._advance()

    def _release_reserved(self, reserved: ReservedPut) -> None:
        with contextlib.suppress(RuntimeError):  # the pool is shut down: so are the stores
            asyncio.get_running_loop().run_in_executor(self.daemon.pool, self.daemon.ops.cancel_put, reserved)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        self.daemon.track(task)
        task.add_done_callback(self.tasks.discard)

    async def _close_when_idle(self) -> None:
        """The peer closed its side: serve what it sent, end its pins and leases, then close
        ours, so that a client that waits for the close knows they have ended."""
        while self.tasks - {asyncio.current_task()}:
            await asyncio.wait(self.tasks - {asyncio.current_task()})
        await self.daemon.end_session(self)
        self.close()

    def stop(self) -> None:
        """The daemon drains: read no more frames; requests already read still finish."""
        self._stopped = True
        self._sync_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
