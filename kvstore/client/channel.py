"""One connection to the daemon: frames, request ids, pipelined requests, and their replies.

Every request goes out under ``lock`` with a fresh id, in one of four ways:

- ``call``: send, then read replies up to its own, and raise the error it carries;
- ``post``: send; its reply is read (and dropped) whenever it comes in front of a later one's;
- ``notify``: ``noreply``: the daemon sends no reply at all (a hint, a lease given back);
- ``pipeline_locked``: send; its reply is read, and handed to the sender's handler, before any
  later request goes out (``settle_locked``), so every later request is ordered after it. At
  most one is outstanding: a shared-memory put's commit (shm_writes.py).

The daemon runs one connection's requests concurrently, so the reply of a posted request may
come before or after a later request's; every other reply comes in the order its request went.
``due`` names noreply requests that ride in front of the next call or pipelined request (the
read cache's touches, shm_reads.py).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvstore.api import MAX_KEYS
from kvstore.errors import CapacityError, LayoutMismatchError
from kvstore.protocol import (
    DEFAULT_MAX_FRAME,
    Code,
    RemoteBadRequest,
    RemoteError,
    encode,
    recv_exact,
    recv_into_view,
    recv_meta,
)

CLOSE_WAIT_S = 2.0  # close() waits at most this long for the daemon to end the connection

Meta = dict[str, Any]
ReplyHandler = Callable[[Meta, float], None]  # (a pipelined request's reply, when the request was sent)

log = logging.getLogger(__name__)


class Channel:
    """A connected socket to the daemon and the requests on it (thread-safe behind ``lock``)."""

    def __init__(self, sock: socket.socket, key_bytes: int) -> None:
        self.sock = sock
        self.key_bytes = key_bytes  # the length of every key a request names
        self.lock = threading.Lock()  # one request on the wire at a time; callers group steps under it
        self.max_frame = DEFAULT_MAX_FRAME  # then the daemon's, once its hello says
        self.max_keys = MAX_KEYS  # keys one request may carry: the daemon's, once its hello says
        self.due: Callable[[], list[Meta]] | None = None  # noreply requests due before the next one
        self._next_id = 0
        self._posted: set[int] = set()  # ids of posted requests whose replies are not read yet
        self._pending: tuple[int, ReplyHandler, float] | None = None  # the pipelined request, if any

    @property
    def is_unix(self) -> bool:
        return self.sock.family == socket.AF_UNIX

    @property
    def has_pending(self) -> bool:
        """Whether a pipelined request's reply is still to be read."""
        return self._pending is not None

    # ------------------------------------------------------------------------ requests

    def call(self, meta: Meta, data: Any = b"", into: memoryview | None = None) -> tuple[Meta, bytes]:
        """One request and its reply; the reply's data goes to ``into`` when given and it fits.

        Raises:
            KeyError, CapacityError, LayoutMismatchError, RemoteError: the error the reply
                carries (``as_exception``), or the pipelined request's (``settle_locked``).
        """
        with self.lock:
            return self.call_locked(meta, data, into)

    def call_locked(self, meta: Meta, data: Any = b"", into: memoryview | None = None) -> tuple[Meta, bytes]:
        """``call`` with ``lock`` held."""
        self.settle_locked()
        request_id = self._stamp(meta)
        # the header alone first: the daemon reserves a put's slots while the data follows
        self.sock.sendall(self._due_frames() + encode(meta, len(data)))
        if len(data):
            self.sock.sendall(data)
        reply, data_len = self.recv_reply(request_id)
        if into is not None and data_len <= len(into):
            recv_into_view(self.sock, into[:data_len])
            body = b""
        else:
            body = bytes(recv_exact(self.sock, data_len)) if data_len else b""
        error = reply.get("error")
        if error is not None:
            raise as_exception(int(error.get("code", 0)), str(error.get("message", "")))
        return reply, body

    def post(self, meta: Meta) -> None:
        """Send a request whose reply is read (and dropped) when it arrives before a later one's."""
        with self.lock:
            self.settle_locked()
            request_id = self._stamp(meta)
            self.sock.sendall(encode(meta))
            self._posted.add(request_id)

    def notify(self, meta: Meta) -> None:
        """Send a request that gets no reply at all (``noreply``)."""
        with self.lock:
            self.notify_locked(meta)

    def notify_locked(self, meta: Meta) -> None:
        """``notify`` with ``lock`` held."""
        self.settle_locked()
        self._next_id += 1
        meta.update(id=self._next_id, noreply=True)
        self.sock.sendall(encode(meta))

    def pipeline_locked(self, meta: Meta, on_reply: ReplyHandler) -> None:
        """Send ``meta`` without waiting for its reply (``lock`` held): ``on_reply`` gets it,
        with the time the request was sent, before the next request goes out."""
        self.settle_locked()
        request_id = self._stamp(meta)
        sent_at = time.monotonic()
        self.sock.sendall(self._due_frames() + encode(meta))
        self._pending = (request_id, on_reply, sent_at)

    def send_due(self) -> None:
        """Send the noreply requests due now, without waiting for the next request."""
        with self.lock:
            self.sock.sendall(self._due_frames())

    # ------------------------------------------------------------------------ replies

    def settle(self) -> None:
        """``settle_locked``, taking ``lock``."""
        with self.lock:
            self.settle_locked()

    def settle_locked(self) -> None:
        """Read the pipelined request's reply, if one is outstanding, and hand it to its
        handler (which may raise): every later request is then ordered after that one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        request_id, on_reply, sent_at = pending
        reply, data_len = self.recv_reply(request_id)
        if data_len:
            recv_exact(self.sock, data_len)
        on_reply(reply, sent_at)

    def settle_posts_locked(self) -> None:
        """Read the replies of every posted request (``lock`` held, nothing pipelined
        outstanding): each has run on the daemon when this returns."""
        while self._posted:
            reply, data_len = recv_meta(self.sock, self.max_frame)
            self._posted.discard(reply.get("id"))
            if data_len:
                recv_exact(self.sock, data_len)

    def recv_reply(self, request_id: int) -> tuple[Meta, int]:
        """Read replies up to ``request_id``'s: its meta and the length of its data, still to
        be read. Posted requests' replies met on the way are dropped."""
        while True:
            reply, data_len = recv_meta(self.sock, self.max_frame)
            reply_id = reply.get("id")
            if reply_id == request_id or reply_id not in self._posted:
                return reply, data_len
            self._posted.discard(reply_id)
            if data_len:
                recv_exact(self.sock, data_len)

    # ------------------------------------------------------------------------ keys, timeouts

    def keys_blob(self, keys: Sequence[bytes]) -> bytes:
        """``keys`` as one request's ``keys`` field (TypeError for a key of another length)."""
        n = self.key_bytes
        for key in keys:
            if not isinstance(key, bytes) or len(key) != n:
                raise TypeError(f"keys must be {n}-byte strings from block_keys(), got {key!r:.60}")
        return b"".join(keys)

    def key_batches(self, keys: Sequence[bytes]) -> list[Sequence[bytes]]:
        """``keys`` in requests of at most ``max_keys`` (the frame bounds them)."""
        return [keys[start : start + self.max_keys] for start in range(0, len(keys), self.max_keys)]

    @contextlib.contextmanager
    def timeout(self, seconds: float) -> Iterator[None]:
        """The socket's timeout raised to ``seconds`` for the block, then put back."""
        before = self.sock.gettimeout()
        self.sock.settimeout(max(seconds, before or 0.0))
        try:
            yield
        finally:
            self.sock.settimeout(before)

    # ------------------------------------------------------------------------ the end

    def close(self) -> None:
        """Settle the pipelined request, send what is due, end our side, and read (and drop)
        what the daemon still sends up to its close: it serves what it was sent, ends the
        connection's pins and leases, then closes its side (or ``CLOSE_WAIT_S`` passes)."""
        with self.lock, contextlib.suppress(OSError):
            try:
                self.settle_locked()  # a pipelined commit must land before its leases end with us
            except (RemoteError, KeyError, CapacityError, LayoutMismatchError) as exc:  # lost either way
                log.warning("the last pipelined request failed: %s", exc)
            finally:
                self.sock.sendall(self._due_frames())
            self.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + CLOSE_WAIT_S
            while (left := deadline - time.monotonic()) > 0:
                self.sock.settimeout(left)
                if not self.sock.recv(1 << 16):
                    break
        self.sock.close()

    def abort(self) -> None:
        """Close the socket at once, without a word to the daemon."""
        with contextlib.suppress(OSError):
            self.sock.close()

    def _stamp(self, meta: Meta) -> int:
        self._next_id += 1
        meta["id"] = self._next_id
        return self._next_id

    def _due_frames(self) -> bytes:
        """The frames of the noreply requests ``due`` names (``lock`` held), or b""."""
        if self.due is None:
            return b""
        frames = []
        for meta in self.due():
            self._stamp(meta)
            frames.append(encode(meta))
        return b"".join(frames)


def as_exception(code: int, message: str) -> Exception:
    """The exception a reply's error stands for (a daemon-side failure, as the store raises it)."""
    if code == Code.NOT_FOUND:
        return KeyError(message)
    if code == Code.CAPACITY:
        return CapacityError(message)
    if code == Code.LAYOUT:
        return LayoutMismatchError(message)
    if code == Code.BAD_REQUEST:
        return RemoteBadRequest(code, message)
    return RemoteError(code, message)
