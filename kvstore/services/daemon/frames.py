"""The receive side of one block-protocol connection: frames parsed from a staging buffer, each
part too big for it (a large meta, every data section) received in place into its target.

    staging:  [ consumed | unparsed: start..end | free: end..STAGING ]
    a frame:  header (8) -> meta (meta_len) -> data (data_len, into its target) -> a Frame

Headers and metas up to ``STAGING`` bytes land in the staging buffer. A data section is
received straight into the target the connection picks for it (``fill``): one buffer of
exactly ``data_len`` bytes, or the host-pool slots reserved for a put's blocks
(kvstore/services/daemon/host_slots.py); staged bytes first, then the socket's, large ones
in a tight loop (kvstore/services/daemon/bulk_io.py). The reader only parses: whether a new
frame may start (back-pressure) is the connection's call.
"""

from __future__ import annotations

from typing import Any

from kvstore.protocol import HEADER, ProtocolError, check_lengths, decode
from kvstore.services.daemon.bulk_io import BULK_MIN, move_while_flowing, trim
from kvstore.services.daemon.host_slots import ReservedPut

STAGING = 64 << 10  # bytes of headers and metas buffered ahead of parsing
HEAD, META, DATA = "head", "meta", "data"

# A whole frame: its meta (or the BAD_FRAME error decoding it met) and its data section.
Frame = tuple[dict[str, Any] | ProtocolError, bytes | bytearray | ReservedPut]


class FrameReader:
    """One connection's frame parser (asyncio's BufferedProtocol fills ``buffer()``)."""

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self.fd = -1  # the socket's descriptor, for the tight loop; -1 before connecting and once closed
        self.state = HEAD
        self.meta: dict[str, Any] | ProtocolError = {}
        self.data_len = 0
        self._meta_len = 0
        self._staging = bytearray(STAGING)
        self._view = memoryview(self._staging)
        self._start = self._end = 0
        self._body: bytearray | ReservedPut | None = None  # the part being filled: meta, then data
        self._pieces: list[memoryview] = []  # the rest of it, in order, when it is received in place
        self._left = 0  # bytes in _pieces

    @property
    def receiving(self) -> bool:
        """A part is being received in place: the socket's bytes go to it, nothing is parsed."""
        return bool(self._pieces)

    def buffer(self) -> memoryview:
        """Where the next bytes from the socket go (BufferedProtocol.get_buffer)."""
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

    def received(self, nbytes: int) -> Frame | None:
        """``nbytes`` arrived in ``buffer()``; the frame they completed, if they did."""
        if not self._pieces:
            self._end += nbytes
            return None
        self._consume(nbytes)
        self._receive_bulk()
        return None if self._pieces else self._part_done()

    def read_header(self) -> bool | ProtocolError:
        """Parse a frame's header if it is staged: True; False: not yet; a ProtocolError:
        its lengths are out of bounds, the stream is out of step (nothing more is parsed)."""
        if self._end - self._start < HEADER.size:
            return False
        self._meta_len, self.data_len = HEADER.unpack_from(self._staging, self._start)
        self._start += HEADER.size
        try:
            check_lengths(self._meta_len, self.data_len, self.max_frame)
        except ProtocolError as exc:
            return exc
        self.state = META
        return True

    def read_meta(self) -> bool:
        """Parse the frame's meta if it is staged, or start receiving a large one in place
        (True); False: not staged yet."""
        if self._meta_len > STAGING:
            self.fill(bytearray(self._meta_len))  # completes no frame: its data comes after it
            return True
        if self._end - self._start < self._meta_len:
            return False
        meta = bytes(self._view[self._start : self._start + self._meta_len])
        self._start += self._meta_len
        self.meta = _decode(meta, self.max_frame)
        self.state = DATA
        return True

    def fill(self, body: bytearray | ReservedPut) -> Frame | None:
        """Make ``body`` the part being received: staged bytes first, then the socket's.
        Returns the frame it completed, if it did at once."""
        self._body = body
        self._pieces = [memoryview(body)] if isinstance(body, bytearray) else list(body.views)
        self._left = sum(len(p) for p in self._pieces)
        while self._pieces and self._start < self._end:  # the staged bytes first
            n = min(len(self._pieces[0]), self._end - self._start)
            self._pieces[0][:n] = self._view[self._start : self._start + n]
            self._start += n
            self._consume(n)
        self._receive_bulk()
        return None if self._pieces else self._part_done()

    def take(self, data: bytes | bytearray | ReservedPut) -> Frame:
        """The frame whose data is complete; the reader moves on to the next header."""
        meta, self.meta, self.state = self.meta, {}, HEAD
        return meta, data

    def abandon(self) -> ReservedPut | None:
        """The connection closed: stop receiving; the reserved put whose data never finished
        arriving, if one was being received (its slots are the caller's to give back)."""
        self.fd = -1
        body, self._body = self._body, None
        self._pieces, self._left = [], 0
        return body if isinstance(body, ReservedPut) else None

    def _consume(self, nbytes: int) -> None:
        """``nbytes`` more of the part being received arrived in its pieces."""
        self._left -= nbytes
        trim(self._pieces, nbytes)

    def _receive_bulk(self) -> None:
        """Read the rest of a large part straight into its pieces while its bytes flow."""
        if self.fd >= 0 and self._left >= BULK_MIN:
            self._left -= move_while_flowing(self.fd, self._pieces, write=False)

    def _part_done(self) -> Frame | None:
        body, self._body = self._body, None
        assert body is not None
        if self.state != META:
            return self.take(body)
        assert isinstance(body, bytearray)
        self.meta = _decode(body, self.max_frame)
        self.state = DATA
        return None


def _decode(meta: bytes | bytearray, max_frame: int) -> dict[str, Any] | ProtocolError:
    try:
        return decode(meta, max_frame)
    except ProtocolError as exc:  # BAD_FRAME: the lengths keep the stream in step
        return exc
