"""The send side of one block-protocol connection: replies written to the transport, a large
one straight from its buffers while the peer keeps pace (kvstore/services/daemon/bulk_io.py),
and the write high-water mark a reply's slot waits on (``drained``).

A reply whose data is ``HeldBlocks`` (a get answered from host-pool slots) is written from
the slots: what the tight loop does not send is copied for the transport, so the caller may
release the blocks as soon as ``write`` returns.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvstore.protocol import HEADER, encode
from kvstore.services.daemon.bulk_io import BULK_MIN, move_while_flowing
from kvstore.services.daemon.host_slots import HeldBlocks

WRITE_HIGH = 1 << 20  # unsent reply bytes above which a reply's slot waits


class ReplyWriter:
    """Writes one connection's replies; ``paused`` while the transport holds more than
    ``WRITE_HIGH`` unsent bytes (asyncio's pause_writing / resume_writing)."""

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self.paused = False
        self._transport: asyncio.Transport | None = None
        self._fd = -1  # the socket's descriptor, for the tight loop; -1 before connecting and once closed
        self._closed = False
        self._waiters: list[asyncio.Future[None]] = []

    def attach(self, transport: asyncio.Transport, fd: int) -> None:
        """The connection was accepted: write to ``transport`` (socket ``fd``)."""
        transport.set_write_buffer_limits(high=WRITE_HIGH)
        self._transport, self._fd = transport, fd

    @property
    def is_open(self) -> bool:
        transport = self._transport
        return not self._closed and transport is not None and not transport.is_closing()

    def write_meta(self, meta: dict[str, Any]) -> None:
        """Write a reply with no data, if the connection is still open (no wait, no error)."""
        if self.is_open:
            assert self._transport is not None
            self._transport.write(encode(meta))

    def write(self, meta: dict[str, Any], payload: Any) -> None:
        """Write a reply (its data: bytes-like or ``HeldBlocks``); ConnectionError if the
        connection closed. The transport buffers what the socket does not take now."""
        head = encode(meta, len(payload))
        assert len(head) - HEADER.size + len(payload) <= self.max_frame
        if not self.is_open:
            raise ConnectionError("the connection closed")
        assert self._transport is not None
        held = isinstance(payload, HeldBlocks)  # views of host slots, released once written
        parts = [memoryview(head)]
        if held:
            parts += payload.views
        elif len(payload):
            parts.append(memoryview(payload).cast("B"))
        if (held or len(payload) >= BULK_MIN) and not self._transport.get_write_buffer_size():
            move_while_flowing(self._fd, parts, write=True)  # straight from the buffers
        for part in parts:  # the transport sends (and buffers) the rest; held slots are copied
            self._transport.write(bytes(part) if held else part)

    async def drained(self) -> None:
        """Wait until the transport's buffer is below the high-water mark; ConnectionError
        if the connection closes first."""
        while self.paused:
            if self._closed:
                raise ConnectionError("the connection closed")
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._wake(None)

    def lost(self) -> None:
        """The connection closed: writes fail, and so do waits for the buffer to drain."""
        self._closed = True
        self._fd = -1
        self._wake(ConnectionError("the connection closed"))

    def _wake(self, exc: Exception | None) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                if exc is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(exc)
