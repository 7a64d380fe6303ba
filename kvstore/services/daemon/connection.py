"""One block-protocol connection, on asyncio's BufferedProtocol: frames are received in place.

Headers and metas up to 64 KiB land in a small staging buffer. A frame's data section is
received straight into its final home: for a put, the host-pool slots the store reserved for
its blocks (the op then only publishes them); otherwise one buffer of exactly ``data_len``
bytes. So a socket put's block bytes are copied once, by the kernel, into the host tier; a
get of blocks all in host RAM is written straight from their slots (``HeldBlocks``).

Large data sections skip the event loop's one-read-per-wakeup pace: once BULK_MIN bytes or
more are left to receive (or to send), the connection reads (writes) them itself in a tight
readv/poll (writev/poll) loop on the loop's thread while the bytes keep flowing, and hands
what is left back to the transport when the peer stalls for BULK_WAIT_MS, falls behind
BULK_RATE, or after BULK_MAX_S: a slow or trickling peer holds the loop a millisecond or two.

    staging:  [ consumed | unparsed: start..end | free: end..STAGING ]
    a frame:  header (8) -> meta (meta_len) -> data (data_len, into its target) -> dispatch

Dispatch: a request that waits on nothing (a put's or a write lease's commit that stays in
memory and finds the store lock free, ``Ops.handle_now``) is served and answered right
there, on the loop, with no task; every other request gets a task, which runs it on a worker.

Back-pressure: a frame takes one of ``max_inflight`` slots when its header is parsed and
gives it back once the transport took its reply below the write high-water mark; no header
is parsed while all slots are taken (nor while a hello runs, a put's slots are being
reserved, or a get's held blocks are being released on a worker), and reading pauses then.
So one connection buffers the staging area plus at most ``max_inflight`` frames and replies,
each at most ``max_frame`` bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import time
from typing import TYPE_CHECKING, Any

from kvstore.protocol import HEADER, Code, ProtocolError, check_lengths, decode, encode
from kvstore.services.daemon.ops import HeldBlocks, ReservedPut, Session
from kvstore.tiers.slab import IOV_MAX

if TYPE_CHECKING:
    from kvstore.services.daemon.server import Daemon

STAGING = 64 << 10  # bytes of headers and metas buffered ahead of parsing
WRITE_HIGH = 1 << 20  # unsent reply bytes above which a reply's slot waits
SOCKET_BUFFER = 4 << 20
HEAD, META, DATA = "head", "meta", "data"
BULK_MIN = 256 << 10  # bytes left in a data section from which it is moved in a tight loop
BULK_WAIT_MS = 1  # a peer silent this long gets its bytes moved by the transport again
BULK_RATE = 100e6  # bytes/s a peer must keep up (after BULK_GRACE bytes) for the loop to wait on it
BULK_GRACE = 64 << 10
BULK_MAX_S = 0.05  # the longest one tight loop holds the event loop


class Connection(asyncio.BufferedProtocol):
    def __init__(self, daemon: Daemon, kind: str) -> None:
        self.daemon = daemon
        self.kind = kind  # "unix" or "tcp"
        self.session = Session(0, kind)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._counted = False  # accepted (not refused as busy or draining)
        self._staging = bytearray(STAGING)
        self._view = memoryview(self._staging)
        self._start = self._end = 0
        self._state = HEAD
        self._meta_len = self._data_len = 0
        self._meta: dict[str, Any] | ProtocolError = {}
        self._body: bytearray | ReservedPut | None = None  # the part being filled: meta, then data
        self._pieces: list[memoryview] = []  # the rest of it, in order, when it is received in place
        self._left = 0  # bytes in _pieces
        self._fd = -1  # the socket's descriptor, for the tight loops
        self._num_slots = 0  # frames parsed whose replies have not drained yet
        self._exclusive = False  # a hello runs: nothing runs beside it
        self._reserving = False  # a put's slots are being reserved
        self._releasing = 0  # gets' held blocks being released on a worker: no new frames
        self._stopped = False  # the daemon drains, or the stream is out of step: no new frames
        self._eof = False  # the peer sent everything; staged frames are still served
        self._reading = True
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
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
        transport.set_write_buffer_limits(high=WRITE_HIGH)
        self._fd = sock.fileno()
        self._counted = True
        self.session = Session(d.next_conn_id(), self.kind)
        d.connection_opened(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._pieces:
            return self._pieces[0]
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == STAGING:  # slide the unparsed bytes to the front
            n = self._end - self._start
            self._staging[:n] = self._staging[self._start : self._end]
            self._start, self._end = 0, n
        assert self._end < STAGING, "staging full while reading"
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._pieces:
            self._consume(nbytes)
            self._receive_bulk()
            if self._pieces:
                return
            self._part_done()
        else:
            self._end += nbytes
        self._advance()

    def _consume(self, nbytes: int) -> None:
        """``nbytes`` more of the part being received arrived in its pieces."""
        self._left -= nbytes
        _trim(self._pieces, nbytes)

    def _receive_bulk(self) -> None:
        """Read the rest of a large part straight into its pieces while its bytes flow."""
        if not self.closed and self._fd >= 0 and self._left >= BULK_MIN:
            self._left -= _move_while_flowing(self._fd, self._pieces, write=False)

    def eof_received(self) -> bool:
        # Frames already received are still served and answered; then the connection closes.
        self._eof = True
        self._reading = False  # the transport stopped reading by itself
        self._spawn(self._close_when_idle())
        return True

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writers(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake_writers(ConnectionError("the connection closed"))
        if not self._counted:
            return
        if isinstance(self._body, ReservedPut):  # its data never finished arriving
            self._release_reserved(self._body)
            self._body = None
        self._pieces, self._left = [], 0
        asyncio.get_running_loop().create_task(self.daemon.connection_closed(self))

    # ------------------------------------------------------------------ framing

    def _advance(self) -> None:
        """Parse what the staging buffer holds, as far as slots and targets allow."""
        while not self.closed and not self._pieces and not self._reserving:
            avail = self._end - self._start
            if self._state == HEAD:
                if (self._stopped or self._exclusive or self._releasing
                        or self._num_slots >= self.daemon.config.max_inflight):
                    break
                if avail < HEADER.size:
                    break
                self._meta_len, self._data_len = HEADER.unpack_from(self._staging, self._start)
                self._start += HEADER.size
                try:
                    check_lengths(self._meta_len, self._data_len, self.daemon.config.max_frame)
                except ProtocolError as exc:  # the stream is out of step: reply, then close
                    self._num_slots += 1
                    self._spawn(self._reply_error(exc, close=True))
                    self._stopped = True
                    break
                self._num_slots += 1
                self._state = META
            elif self._state == META:
                if self._meta_len <= STAGING:
                    if avail < self._meta_len:
                        break
                    meta = bytes(self._view[self._start : self._start + self._meta_len])
                    self._start += self._meta_len
                    self._meta = _decode(meta, self.daemon.config.max_frame)
                    self._state = DATA
                else:
                    self._fill(bytearray(self._meta_len))
            elif self._state == DATA:
                if self._data_len == 0:
                    self._dispatch(b"")
                elif self._may_reserve():
                    assert isinstance(self._meta, dict)
                    # free slots and a free store lock: taken here, with no hop to a worker
                    reserved = self.daemon.ops.reserve_put(self.session, self._meta, self._data_len, blocking=False)
                    if reserved is not None:
                        self._fill(reserved)
                    else:
                        self._reserving = True
                        self._spawn(self._reserve())
                else:
                    self._fill(bytearray(self._data_len))
        self._sync_reading()

    def _fill(self, body: bytearray | ReservedPut) -> None:
        """Make ``body`` the part being received: staged bytes first, then the socket's."""
        self._body = body
        self._pieces = [memoryview(body)] if isinstance(body, bytearray) else list(body.views)
        self._left = sum(len(p) for p in self._pieces)
        while self._pieces and self._start < self._end:  # the staged bytes first
            n = min(len(self._pieces[0]), self._end - self._start)
            self._pieces[0][:n] = self._view[self._start : self._start + n]
            self._start += n
            self._consume(n)
        self._receive_bulk()
        if not self._pieces:
            self._part_done()

    def _part_done(self) -> None:
        body, self._body = self._body, None
        if self._state == META:
            assert isinstance(body, bytearray)
            self._meta = _decode(body, self.daemon.config.max_frame)
            self._state = DATA
        else:
            assert body is not None
            self._dispatch(body)

    def _may_reserve(self) -> bool:
        meta = self._meta
        return isinstance(meta, dict) and meta.get("op") == "put" and self.session.principal is not None

    async def _reserve(self) -> None:
        """Ask the store for host slots to receive this put's blocks in; else a plain buffer."""
        loop = asyncio.get_running_loop()
        assert isinstance(self._meta, dict)
        try:
            reserved = await loop.run_in_executor(self.daemon.pool, self.daemon.ops.reserve_put, self.session,
                                                  self._meta, self._data_len)
        except RuntimeError:  # the pool is shut down
            reserved = None
        self._reserving = False
        if self.closed:
            if reserved is not None:
                self._release_reserved(reserved)
            return
        self._fill(reserved if reserved is not None else bytearray(self._data_len))
        self._advance()

    def _dispatch(self, data: bytes | bytearray | ReservedPut) -> None:
        meta, self._meta, self._state = self._meta, {}, HEAD
        if isinstance(meta, ProtocolError):
            self._spawn(self._reply_error(meta, close=False))
        elif not self._serve_now(meta, data):
            self._exclusive = self.session.principal is None  # hello runs alone
            self._spawn(self._serve(meta, data))

    def _serve_now(self, meta: dict[str, Any], data: bytes | bytearray | ReservedPut) -> bool:
        """Serve a request that waits on nothing (a commit: ``Ops.handle_now``) right here,
        reply included, with no task and no hop through the event loop. False: it was not
        run (it would wait, or its reply's slot would wait for the transport); a task serves it.
        The caller goes on parsing: the frame's slot is given back without ``_advance``."""
        if self._write_paused:
            return False
        reply = self.daemon.ops.handle_now(self.session, meta, data)
        if reply is None:
            return False
        out, payload = reply
        assert not len(payload), "a commit's reply carries no data"
        transport = self.transport
        if meta.get("noreply") is not True and not self.closed and transport is not None and not transport.is_closing():
            transport.write(encode(out))
        if self._write_paused:  # that reply crossed the high-water mark: its slot waits for it
            self._spawn(self._slot_after_drain())
        else:
            self._num_slots -= 1
        return True

    async def _slot_after_drain(self) -> None:
        try:
            await self._drained()
        except ConnectionError:
            pass
        finally:
            self._slot_done()

    def _sync_reading(self) -> None:
        want = not (self.closed or self._eof or self._reserving
                    or (self._state == HEAD and not self._pieces and (self._stopped or self._exclusive
                        or self._releasing or self._num_slots >= self.daemon.config.max_inflight)))
        if want == self._reading or self.transport is None or self.transport.is_closing():
            return
        self._reading = want
        if want:
            self.transport.resume_reading()
        else:
            self.transport.pause_reading()

    # ------------------------------------------------------------------ requests and replies

    async def _serve(self, meta: dict[str, Any], data: bytes | bytearray | ReservedPut) -> None:
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
        head = encode(meta, len(payload))
        assert len(head) - HEADER.size + len(payload) <= self.daemon.config.max_frame
        if self.closed or self.transport is None or self.transport.is_closing():
            raise ConnectionError("the connection closed")
        held = isinstance(payload, HeldBlocks)  # views of host slots, released once written
        parts = [memoryview(head)]
        if held:
            parts += payload.views
        elif len(payload):
            parts.append(memoryview(payload).cast("B"))
        if (held or len(payload) >= BULK_MIN) and not self.transport.get_write_buffer_size():
            _move_while_flowing(self._fd, parts, write=True)  # straight from the buffers
        for part in parts:  # the transport sends (and buffers) the rest; held slots are copied
            self.transport.write(bytes(part) if held else part)
        if held:  # before any await: no later frame of this connection is parsed before it
            self._let_go(payload)
        await self._drained()  # the reply's slot frees only once the transport took it

    async def _drained(self) -> None:
        """Wait until the transport's buffer is below the high-water mark; ConnectionError
        if the connection closes first."""
        while self._write_paused:
            if self.closed:
                raise ConnectionError("the connection closed")
            waiter = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(waiter)
            await waiter

    def _slot_done(self) -> None:
        self._num_slots -= 1
        if not self.closed:
            self._advance()

    def _wake_writers(self, exc: Exception | None) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                if exc is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(exc)

    def _let_go(self, held: HeldBlocks) -> None:
        """Release a get's blocks once its reply is written (or copied for the transport):
        here when the store lock is free, else on a worker, and this connection parses no
        further frame until then (the client's next request, say a delete of those blocks,
        must find them released)."""
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
        loop = asyncio.get_running_loop()
        with contextlib.suppress(RuntimeError):
            loop.run_in_executor(self.daemon.pool, self.daemon.ops.cancel_put, reserved)

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


class BulkPace:
    """One tight loop's clock: whether to keep waiting on its peer."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.moved = 0  # bytes moved so far

    def keeps_up(self) -> bool:
        elapsed = time.monotonic() - self.start
        return elapsed < BULK_MAX_S and self.moved + BULK_GRACE >= BULK_RATE * elapsed


def _move_while_flowing(fd: int, parts: list[memoryview], *, write: bool) -> int:
    """``readv`` into (``writev`` from) ``parts`` in a tight loop while the peer keeps pace;
    ``parts`` is trimmed to what is left. Stops when the peer stalls (BulkPace), at the end of
    the stream, or at an error, which the transport's own next read or write then meets.
    Returns the bytes moved."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT if write else select.POLLIN)
    move = os.writev if write else os.readv
    pace = BulkPace()
    while parts:
        try:
            n = move(fd, parts[:IOV_MAX])
        except BlockingIOError:
            if not pace.keeps_up() or not poller.poll(BULK_WAIT_MS):
                break
            continue
        except OSError:
            break
        if n == 0:  # end of stream
            break
        pace.moved += n
        _trim(parts, n)
    return pace.moved


def _trim(parts: list[memoryview], nbytes: int) -> None:
    """Drop the first ``nbytes`` of ``parts`` (whole parts, then the front of one)."""
    done = 0
    while nbytes and nbytes >= len(parts[done]):
        nbytes -= len(parts[done])
        done += 1
    del parts[:done]
    if nbytes:
        parts[0] = parts[0][nbytes:]


def _decode(meta: bytes | bytearray, max_frame: int) -> dict[str, Any] | ProtocolError:
    try:
        return decode(meta, max_frame)
    except ProtocolError as exc:  # BAD_FRAME: the lengths keep the stream in step
        return exc
