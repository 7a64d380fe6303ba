"""The replies of a pipeline of GETs, each value read from the socket straight into its buffer.

redis-py's own parser (pure Python, without hiredis) copies a value three times after the
kernel's copy into a ``recv``'s ``bytes``: into a ``BytesIO``, back out as another ``bytes``,
and once more to drop its CRLF. With hiredis it is copied twice (hiredis's own buffer, then
a ``bytes`` object). Here the header line of each reply is read in a small chunk, and the
value then lands, with ``recv_into``, in a buffer of exactly its size that the caller gave:
the kernel's copy is the only one. The caller checks it there (tiers.remote.codec) and
copies the payload once, into its tensor.

Only the replies of GET are read here: a bulk string (the value), a null (RESP2 ``$-1``,
RESP3 ``_``) and an error (``-`` line, RESP3 ``!`` blob), which becomes the exception
redis-py would have made of it (``MOVED``, ``ASK``, ``CLUSTERDOWN``, ``OOM`` ...). Anything
else means the connection is out of step: ``ProtocolError``, and the caller disconnects it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from redis._parsers import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

CRLF = b"\r\n"
LINE_READ = 512  # bytes asked of the socket for a header line: the rest of a value goes straight to its buffer
MAX_ODD_VALUE = 64 << 20  # a value of another length than asked is read whole only up to this (else skipped)
MAX_ERROR = 64 << 10  # the longest RESP3 blob error read (Redis's are one short line)
# What redis-py's parsers and reply callbacks raise for a reply no Redis sends (a MOVED that
# names no node, an INFO that is an integer, a SCAN that is not [cursor, names]): its
# callers take these as they take a ProtocolError.
UNREADABLE = (ValueError, TypeError, AttributeError, IndexError, KeyError)


class ReadableSocket(Protocol):
    def recv(self, size: int) -> bytes: ...

    def recv_into(self, buffer: Any, size: int = 0) -> int: ...


class ProtocolError(RedisConnectionError):
    """The socket gave something no GET replies with: the connection is out of step."""


class Odd:
    """A reply that is a value, but not of the length asked for (not read, or read aside)."""

    def __init__(self, value: memoryview | None, length: int) -> None:
        self.value, self.length = value, length


Reply = memoryview | Odd | BaseException | None


class GetReplies:
    """Reads ``n`` GET replies from one connected socket (its replies, nothing before them
    left unread). A value of ``value_bytes`` goes into ``buffer(i)``, the i-th reply's own
    writable memory of that size; a value of another length comes back as ``Odd`` (read
    into fresh memory up to MAX_ODD_VALUE bytes, else skipped); a null as None; an error
    reply as its exception. Socket errors propagate (the connection is then unusable)."""

    def __init__(self, sock: ReadableSocket) -> None:
        self._sock = sock
        self._pending = b""  # bytes received past the last reply consumed
        self._pos = 0

    def read(self, n: int, value_bytes: int, buffer: Callable[[int], memoryview]) -> list[Reply]:
        replies = [self._one(i, value_bytes, buffer) for i in range(n)]
        if self._pos != len(self._pending):
            raise ProtocolError(f"{len(self._pending) - self._pos} bytes past the last of {n} replies")
        return replies

    # ----------------------------------------------------------------------------- one reply

    def _one(self, i: int, value_bytes: int, buffer: Callable[[int], memoryview]) -> Reply:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            length = _int(rest)
            if length < 0:
                return None  # RESP2 null
            if length == value_bytes:
                view = buffer(i)
                self._fill(view)
                self._expect_crlf()
                return view
            return self._odd(length)
        if kind == b"_":
            return None  # RESP3 null
        if kind == b"-":
            return _error(rest)
        if kind == b"!":  # RESP3 blob error
            length = _int(rest)
            if not 0 <= length <= MAX_ERROR:
                raise ProtocolError(f"a blob error of {length} bytes (at most {MAX_ERROR} are read)")
            blob = memoryview(bytearray(length))
            self._fill(blob)
            self._expect_crlf()
            return _error(blob)
        raise ProtocolError(f"unexpected reply to GET: {bytes(line[:40])!r}")

    def _odd(self, length: int) -> Odd:
        if length > MAX_ODD_VALUE:
            self._skip(length)
            self._expect_crlf()
            return Odd(None, length)
        view = memoryview(bytearray(length))
        self._fill(view)
        self._expect_crlf()
        return Odd(view, length)

    # ----------------------------------------------------------------------------- bytes

    def _line(self) -> bytes:
        """The next CRLF-terminated line, without its CRLF."""
        end = self._pending.find(CRLF, self._pos)
        while end < 0:
            self._pending = self._pending[self._pos :] + self._recv(LINE_READ)
            self._pos = 0
            end = self._pending.find(CRLF)
        line = self._pending[self._pos : end]
        self._pos = end + 2
        return line

    def _fill(self, view: memoryview) -> None:
        """Fill ``view``: from what was received already, then straight from the socket."""
        have = len(self._pending) - self._pos
        got = min(have, len(view))
        if got:
            view[:got] = self._pending[self._pos : self._pos + got]
            self._pos += got
        while got < len(view):
            count = self._sock.recv_into(view[got:], len(view) - got)
            if count == 0:
                raise RedisConnectionError("Connection closed by server.")
            got += count

    def _skip(self, length: int) -> None:
        scratch = memoryview(bytearray(min(length, 1 << 20)))
        while length > 0:
            part = scratch[: min(length, len(scratch))]
            self._fill(part)
            length -= len(part)

    def _expect_crlf(self) -> None:
        while len(self._pending) - self._pos < 2:
            self._pending = self._pending[self._pos :] + self._recv(LINE_READ)
            self._pos = 0
        if self._pending[self._pos : self._pos + 2] != CRLF:
            raise ProtocolError("a value's CRLF is missing")
        self._pos += 2

    def _recv(self, size: int) -> bytes:
        data = self._sock.recv(size)
        if not data:
            raise RedisConnectionError("Connection closed by server.")
        return data


def _error(text: bytes | memoryview) -> BaseException:
    """The exception redis-py makes of an error reply; a plain ResponseError where redis-py
    cannot read a redirection's slot or node (``MOVED x``)."""
    message = bytes(text).decode("utf-8", errors="replace")
    try:
        return BaseParser.parse_error(message)
    except ValueError:
        return ResponseError(message)


def _int(text: bytes) -> int:
    try:
        return int(text)
    except ValueError:
        raise ProtocolError(f"bad length in a reply: {text[:20]!r}") from None
