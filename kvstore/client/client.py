"""The daemon's client: ``kvstore.connect(url, ...)`` -> StoreClient, TieredStore's semantics.

A client is one connection, one request at a time (thread-safe behind a lock; open one
client per thread for parallel traffic). Over a Unix socket it maps the daemon's host pool
when offered and copies leased slots itself (docs/protocol.md, "Shared memory").
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvstore import env
from kvstore.api import BlockStore, check_ttl
from kvstore.client.copier import Copier
from kvstore.client.manage import ManagementCalls, socket_timeout
from kvstore.client.pool_map import MappedPool
from kvstore.errors import CapacityError, DaemonUnreachableError, LayoutMismatchError
from kvstore.keys import BlockHasher, ExtraKey, Namespace
from kvstore.layout import KVLayout, raw_rows
from kvstore.protocol import (
    DEFAULT_MAX_FRAME,
    VERSION,
    Code,
    RemoteBadRequest,
    RemoteError,
    encode,
    layout_to_dict,
    recv_exact,
    recv_into_view,
    recv_meta,
)
from kvstore.results import HOST, FetchHandle, FetchResult, PrefixMatch
from kvstore.tiers.host import PayloadViews

TIER_NAMES = {"h": "host", "d": "disk", "r": "remote"}
TOUCH_BATCH = 4096  # lock-free reads told to the daemon in one touch, at the latest
TOUCH_DELAY_S = 0.05  # or once this long has passed, or with the next request
CLOSE_WAIT_S = 2.0  # close() waits at most this long for the daemon to end the connection

log = logging.getLogger(__name__)


def connect(url: str, token: str | None = None, *, layout: KVLayout, model_id: str,
            hash_algo: str = "sha256", shm: bool | None = None, timeout: float = 30.0) -> StoreClient:
    """Open a client of the daemon at ``url`` for one namespace (model id + KV layout).

    Args:
        url: ``unix://PATH`` (absolute, ``unix:///run/kvstore.sock``, or relative to the
            working directory, ``unix://.kvstore/kvstore.sock``) or ``tcp://HOST:PORT``.
        token: the caller's token (or KVSTORE_TOKEN); it decides the tenant.
        layout, model_id, hash_algo: the namespace, as for a TieredStore.
        shm: use the shared-memory path when the daemon offers it (default: on Unix sockets,
            unless KVSTORE_NO_SHM=1).
        timeout: seconds one request may take.

    Raises:
        RemoteError: the daemon refused the hello (bad token, version, layout, no slot).
        ValueError: ``url`` is neither form.
        OSError: nothing listens at ``url`` (the message names the path or address tried).
    """
    return StoreClient(url, token if token is not None else env.token(), layout, model_id, hash_algo, shm, timeout)


class StoreClient(ManagementCalls):
    """A TieredStore-like view of one namespace in a daemon."""

    def __init__(self, url: str, token: str | None, layout: KVLayout, model_id: str, hash_algo: str,
                 shm: bool | None, timeout: float) -> None:
        kind, address = parse_address(url)
        if kind == "unix":
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            try:
                self._sock = socket.create_connection(address, timeout=timeout)
            except OSError as exc:
                raise _unreachable(exc, url, f"{address[0]}:{address[1]}") from None
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(timeout)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            self._sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        if kind == "unix":
            try:
                self._sock.connect(address)
            except OSError as exc:
                self._sock.close()
                raise _unreachable(exc, url, f"the socket {os.path.abspath(address)}") from None
        self.url = url
        self.layout = layout
        self.model_id = model_id
        self.hasher = BlockHasher(Namespace(model_id, layout, hash_algo))
        self._payload = layout.bytes_per_block
        self._lock = threading.Lock()
        self._next_id = 0
        self._posted: set[int] = set()  # ids of _post() requests whose replies are not read yet
        self._max_frame = DEFAULT_MAX_FRAME
        self._mapped: MappedPool | None = None
        self._pool: torch.Tensor | None = None
        self._payloads: PayloadViews | None = None  # the pool's payloads as typed rows
        self._generations: np.ndarray | None = None  # set: lock-free reads of cached slots
        self._slots: dict[bytes, tuple[int, int]] = {}  # key -> (slot, generation) of slots once held under a lease
        # write leases for the next puts, (lease, slots, deadline), up to two ahead; and the
        # last put's commit, sent but its reply not read yet: (request id, keys, sent_at, and
        # the slots written with their generations, read while the lease held them)
        self._write_leases: deque[tuple[int, list[int], float]] = deque()
        self._commit: tuple[int, list[bytes], float, list[int], list[int]] | None = None
        self.num_lost_puts = 0  # blocks of puts whose commit found its lease expired
        self._touched: list[bytes] = []  # blocks read lock-free, not yet told to the daemon
        self._touch_due = 0.0
        self._executor: ThreadPoolExecutor | None = None
        self._copier = Copier()  # a put's copy into the mapped pool, beside the daemon's commit of the last
        want_shm = (kind == "unix") if shm is None else shm
        want_shm = want_shm and not env.shm_disabled()
        hello = self._call({"op": "hello", "version": VERSION, "token": token, "model_id": model_id,
                            "layout": layout_to_dict(layout), "hash_algo": hash_algo, "shm": want_shm})[0]
        self.tenant: str = hello["tenant"]
        self.namespace_id: str = hello["namespace"]
        self._max_frame = hello["max_frame"]
        self.max_blocks: int = hello["max_blocks"]
        self.max_keys: int = hello["max_keys"]
        self._lease_s: float = hello["lease_s"]
        if hello.get("shm"):
            self._map_pool(hello["shm"])

    def _map_pool(self, info: dict[str, Any]) -> None:
        has_generations = bool(info.get("generations"))
        self._mapped = MappedPool(info["path"], info["slot_bytes"], info["num_slots"], has_generations)
        self._pool = self._mapped.slots
        self._payloads = PayloadViews(self._pool[:, : self._payload])
        if has_generations and MappedPool.lock_free():
            self._generations = self._mapped.generations

    @property
    def uses_shm(self) -> bool:
        return self._pool is not None

    # ------------------------------------------------------------------------ transport

    def _call(self, meta: dict[str, Any], data: Any = b"", into: memoryview | None = None) -> tuple[dict[str, Any], bytes]:
        """One request and its response; the response's data goes to ``into`` when given."""
        with self._lock:
            return self._call_locked(meta, data, into)

    def _call_locked(self, meta: dict[str, Any], data: Any = b"", into: memoryview | None = None
                     ) -> tuple[dict[str, Any], bytes]:
        self._settle()
        self._next_id += 1
        meta["id"] = self._next_id
        # the header alone first: the daemon reserves the put's slots while the data follows
        self._sock.sendall(self._touch_frame() + encode(meta, len(data)))
        if len(data):
            self._sock.sendall(data)
        reply, data_len = self._recv_reply(self._next_id)
        if into is not None and data_len <= len(into):
            recv_into_view(self._sock, into[:data_len])
            body = b""
        else:
            body = bytes(recv_exact(self._sock, data_len)) if data_len else b""
        error = reply.get("error")
        if error is not None:
            raise _as_exception(int(error.get("code", 0)), str(error.get("message", "")))
        return reply, body

    def _post(self, meta: dict[str, Any]) -> None:
        """Send a request whose reply is read (and dropped) when it arrives before a later one's."""
        with self._lock:
            self._settle()
            self._next_id += 1
            meta["id"] = self._next_id
            self._sock.sendall(encode(meta))
            self._posted.add(self._next_id)

    def _notify(self, meta: dict[str, Any]) -> None:
        """Send a request that gets no reply at all (``noreply``: a hint, or giving back)."""
        with self._lock:
            self._notify_locked(meta)

    def _notify_locked(self, meta: dict[str, Any]) -> None:
        self._settle()
        self._next_id += 1
        meta.update(id=self._next_id, noreply=True)
        self._sock.sendall(encode(meta))

    def _settle(self) -> None:
        """Read the reply of the last put's commit, if one is outstanding (``_lock`` held):
        every later request is then ordered after that put."""
        pending, self._commit = self._commit, None
        if pending is None:
            return
        request_id, keys, sent_at, slots, gens = pending
        reply, data_len = self._recv_reply(request_id)
        if data_len:
            recv_exact(self._sock, data_len)
        error = reply.get("error")
        if error is not None:
            code, message = int(error.get("code", 0)), str(error.get("message", ""))
            if code == Code.LEASE:  # the daemon stalled past the lease: those blocks were not stored
                self.num_lost_puts += len(keys)
                log.warning("a shared-memory put of %d blocks was not stored: %s", len(keys), message)
                return
            raise _as_exception(code, f"an earlier shared-memory put failed: {message}")
        self._remember(keys, slots, gens)
        self._keep_next(reply, sent_at)

    def _keep_next(self, reply: dict[str, Any], sent_at: float) -> None:
        nxt = reply.get("next")
        if nxt is not None:
            self._write_leases.append((nxt["lease"], nxt["slots"], sent_at + 0.5 * nxt["lease_s"]))

    def _settle_posts(self) -> None:
        """Read the replies of every posted request (``_lock`` held, the last commit settled):
        each has run on the daemon when this returns."""
        while self._posted:
            reply, data_len = recv_meta(self._sock, self._max_frame)
            self._posted.discard(reply.get("id"))
            if data_len:
                recv_exact(self._sock, data_len)

    def _recv_reply(self, request_id: int) -> tuple[dict[str, Any], int]:
        """Read replies until ``request_id``'s. The daemon runs a connection's requests
        concurrently, so a posted request's reply may come before or after a later one's."""
        while True:
            reply, data_len = recv_meta(self._sock, self._max_frame)
            reply_id = reply.get("id")
            if reply_id == request_id or reply_id not in self._posted:
                return reply, data_len
            self._posted.discard(reply_id)
            if data_len:
                recv_exact(self._sock, data_len)

    def _keys_blob(self, keys: Sequence[bytes]) -> bytes:
        n = self.hasher.key_bytes
        for key in keys:
            if not isinstance(key, bytes) or len(key) != n:
                raise TypeError(f"keys must be {n}-byte strings from block_keys(), got {key!r:.60}")
        return b"".join(keys)

    # ------------------------------------------------------------------------ the store API

    @property
    def namespace(self) -> Namespace:
        return self.hasher.namespace

    def block_keys(self, token_ids: Sequence[int] | np.ndarray, tenant: str = "",
                   extra_keys: Sequence[Sequence[ExtraKey] | None] | None = None,
                   parent: bytes | None = None) -> list[bytes]:
        """One chained key per full block, salted with ``tenant``; "" is this connection's
        tenant (its token's, set by the daemon). The daemon files every key under the token's
        tenant as well, so another tenant name only partitions this token's own blocks."""
        return self.hasher.block_keys(token_ids, tenant or self.tenant, extra_keys, parent)

    def lookup(self, keys: Sequence[bytes]) -> PrefixMatch:
        """The leading run of ``keys`` the daemon holds, and the fastest tier of each."""
        tiers: list[str] = []
        for chunk in self._key_batches(keys):
            reply = self._call({"op": "lookup", "keys": self._keys_blob(chunk)})[0]
            tiers += [TIER_NAMES[c] for c in reply["tiers"]]
            if reply["num_blocks"] < len(chunk):
                break
        return PrefixMatch(len(tiers), tuple(tiers))

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor, *, tenant: str = "") -> None:
        """Store ``blocks[i]`` under ``keys[i]`` (CapacityError when the daemon has no room).
        ``tenant`` salted the keys already; the daemon files them under the token's tenant.

        Over shared memory the call returns once the bytes are in the daemon's slots and their
        commit is sent: this client's next request is ordered after it (and reports its
        failure, if any); other clients see the blocks once the daemon has read the commit,
        or once ``flush()`` returns."""
        src = self.layout.input_blocks(blocks, len(keys))
        for start in range(0, len(keys), self.max_blocks):
            stop = min(len(keys), start + self.max_blocks)
            rows = src if stop - start == len(src) else src[start:stop]
            if self._pool is None or not self._put_shm(keys[start:stop], rows):
                data = raw_rows(rows).numpy().data.cast("B")
                self._call({"op": "put", "keys": self._keys_blob(keys[start:stop])}, data)

    def _put_shm(self, keys: Sequence[bytes], src: torch.Tensor) -> bool:
        """Write the blocks into reserved host slots and send their commit, without waiting
        for it: the next request (the next put's, after its copy) reads the reply. Every
        commit reserves the slots of the put after next, so a run of equal-sized puts copies
        while the previous commit is on its way and pays no round trip of its own."""
        assert self._payloads is not None
        n = len(keys)
        with self._lock:
            lease = self._write_lease(n, keys)
        if lease is None:
            return False  # the socket path may still overflow to disk
        lease_id, slots, deadline = lease
        if time.monotonic() >= deadline:  # never start writing a slot past the lease
            self._notify({"op": "release", "lease": lease_id, "kind": "write"})  # unwritten: never commit it
            return False
        self._copier.copy(self._payloads.pieces(slots, src))
        gens = self._generations_of(slots)  # stable: the lease still holds the slots
        with self._lock:
            self._settle()
            self._next_id += 1
            sent_at = time.monotonic()
            self._sock.sendall(self._touch_frame() + encode(
                {"op": "commit", "lease": lease_id, "keys": self._keys_blob(keys), "reserve": n, "id": self._next_id}))
            self._commit = (self._next_id, list(keys), sent_at, slots, gens)
        return True

    def _write_lease(self, n: int, keys: Sequence[bytes]) -> tuple[int, list[int], float] | None:
        """A write lease of ``n`` slots for this put (``_lock`` held): one reserved ahead, or
        a new one (which also reserves the next put's). None when the host has no room."""
        leases = self._write_leases
        if not leases:
            self._settle()  # the last commit may bring one
        now = time.monotonic()
        while leases and (len(leases[0][1]) != n or now >= leases[0][2]):
            self._notify_locked({"op": "release", "lease": leases.popleft()[0], "kind": "write"})
        if leases:
            return leases.popleft()
        sent_at = time.monotonic()
        try:
            reply = self._call_locked({"op": "reserve", "keys": self._keys_blob(keys), "reserve": n})[0]
        except CapacityError:
            return None
        self._keep_next(reply, sent_at)
        return reply["lease"], reply["slots"], sent_at + 0.5 * reply["lease_s"]

    def get(self, keys: Sequence[bytes], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks under ``keys``; KeyError naming the first one the daemon lacks."""
        out = self.layout.output_blocks(len(keys), out)
        n = self._read(keys, out).num_blocks
        if n < len(keys):
            raise KeyError(f"block {keys[n].hex()} (#{n}) is not in the store")
        return out

    def fetch(self, keys: Sequence[bytes], into: torch.Tensor) -> FetchHandle:
        """Copy the leading run of found blocks into ``into`` on a background thread."""
        self.layout.check_blocks(into, len(keys))
        if not into.is_contiguous():
            raise ValueError("fetch(into=...) needs a contiguous tensor")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvstore-client")
        keys = list(keys)

        def run() -> FetchResult:
            if into.device.type == "cpu":
                return self._read(keys, into)
            staging = torch.empty((len(keys), *self.layout.block_shape), dtype=self.layout.dtype)
            result = self._read(keys, staging)
            into[: result.num_blocks].copy_(staging[: result.num_blocks])
            return result

        return FetchHandle(self._executor.submit(run), len(keys))

    def _read(self, keys: Sequence[bytes], out: torch.Tensor) -> FetchResult:
        """The leading run of found blocks into ``out`` (the layout's blocks, contiguous, CPU).
        ``out`` stays typed down to the copies (PayloadViews views the pool as its rows): a
        byte view of it is made only for the socket path."""
        if self._commit is not None:  # once the last put is settled its slots are remembered: lock-free reads
            with self._lock:
                self._settle()
        tiers: list[str] = []
        for start in range(0, len(keys), self.max_blocks):
            chunk = keys[start : start + self.max_blocks]
            got = self._read_chunk(chunk, out if len(chunk) == len(out) else out[start : start + len(chunk)])
            tiers += got
            if len(got) < len(chunk):
                break
        return FetchResult(len(tiers), tuple(tiers))

    def _read_chunk(self, keys: Sequence[bytes], dst: torch.Tensor) -> list[str]:
        tiers: list[str] = []
        if self._pool is not None:
            n = self._read_cached(keys, dst)
            if n < len(keys):
                n += self._read_leased(keys[n:], dst[n:])
            tiers = [HOST] * n
            if n == len(keys):
                return tiers
        rest = keys[len(tiers) :]
        view = raw_rows(dst[len(tiers) :]).numpy().data.cast("B")
        reply = self._call({"op": "get", "keys": self._keys_blob(rest)}, into=view)[0]
        return tiers + [TIER_NAMES[c] for c in reply.get("tiers", "h" * reply["num_blocks"])]

    def _read_cached(self, keys: Sequence[bytes], dst: torch.Tensor) -> int:
        """Copy the leading run of ``keys`` remembered in slots this client once held under a
        lease, without taking one: a slot counts only if its generation is unchanged after the
        copy (the daemon bumps it before the slot can be reused, so then no other bytes were in
        it). Returns how many leading rows of ``dst`` hold their block; the daemon is told (no
        reply)."""
        mapped = self._mapped
        if self._generations is None or self._payloads is None or mapped is None:
            return 0
        slots: list[int] = []
        gens: list[int] = []
        for key in keys:
            hit = self._slots.get(key)
            if hit is None:
                break
            slots.append(hit[0])
            gens.append(hit[1])
        if not slots:
            return 0
        # The generations are read one by one (a few dozen: numpy's setup would cost more
        # than the reads, several times more when the caches are cold, as a serving get finds them).
        n = _same_prefix(mapped.generations_of(slots), gens)  # known stale before the copy: not copied
        if n:
            # torch's own copy (nothing runs beside a read), into the caller's typed rows
            self._payloads.read(slots if n == len(slots) else slots[:n], dst if n == len(dst) else dst[:n])
            n = _same_prefix(mapped.generations_of(slots[:n]), gens)  # after: the copy is valid
        for key in keys[n : len(slots)]:
            self._slots.pop(key, None)  # maybe stale: the next lease names the slot again
        if n:
            self._touched += keys[:n]
            now = time.monotonic()
            if len(self._touched) >= TOUCH_BATCH or now >= self._touch_due:
                with self._lock:
                    self._sock.sendall(self._touch_frame())
                self._touch_due = now + TOUCH_DELAY_S
        return n

    def _touch_frame(self) -> bytes:
        """A ``touch`` of the blocks read lock-free since the last one (their recency and read
        counters, which the daemon did not see), or b"". It needs no reply and gets none."""
        if not self._touched:
            return b""
        keys, self._touched = self._touched, []
        frames = []
        for batch in self._key_batches(keys):
            self._next_id += 1
            frames.append(encode({"op": "touch", "keys": b"".join(batch), "noreply": True, "id": self._next_id}))
        return b"".join(frames)

    def _read_leased(self, keys: Sequence[bytes], dst: torch.Tensor) -> int:
        """Copy the leading run of host blocks under a read lease; returns how many."""
        assert self._payloads is not None
        # The daemon's lease started after sent_at, so a copy done before sent_at + lease_s
        # was done under the lease; then the release needs no answer (it is pipelined).
        sent_at = time.monotonic()
        reply = self._call({"op": "get", "keys": self._keys_blob(keys), "shm": True})[0]
        n, deadline = reply["num_blocks"], sent_at + 0.5 * reply["lease_s"]
        copied = time.monotonic() < deadline  # never start copying past the lease
        gens = self._generations_of(reply["slots"]) if copied else []  # stable: the lease holds them
        if n and copied:
            self._payloads.read(reply["slots"], dst[:n])
        if copied and time.monotonic() < deadline:
            self._post({"op": "release", "lease": reply["lease"]})
        elif not self._call({"op": "release", "lease": reply["lease"]})[0]["valid"] or not copied:
            return 0
        self._remember(keys[:n], reply["slots"], gens)
        return n

    def _generations_of(self, slots: list[int]) -> list[int]:
        """The generations of slots this client holds under a lease (so they cannot change),
        read from the pool file; [] without lock-free reads."""
        if self._generations is None or self._mapped is None:
            return []
        return self._mapped.generations_of(slots)

    def _remember(self, keys: Sequence[bytes], slots: list[int], gens: list[int]) -> None:
        """Note where ``keys`` live (slots held under a lease), for lock-free reads (bounded by the pool)."""
        if self._generations is None or len(gens) != len(keys) or len(slots) != len(keys):
            return
        if len(self._slots) + len(keys) > 2 * len(self._generations):
            self._slots.clear()  # stale entries cost only a lease; keep the map small
        self._slots.update(zip(keys, zip(slots, gens, strict=True), strict=True))

    def _key_batches(self, keys: Sequence[bytes]) -> list[Sequence[bytes]]:
        """``keys`` in requests of at most the daemon's ``max_keys`` (the frame bounds them)."""
        return [keys[start : start + self.max_keys] for start in range(0, len(keys), self.max_keys)]

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        found: list[bool] = []
        for batch in self._key_batches(keys):
            found += self._call({"op": "exists", "keys": self._keys_blob(batch)})[0]["found"]
        return found

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self.contains(keys)

    def delete(self, keys: Sequence[bytes], *, descendants: bool = False, tenant: str | None = None) -> int:
        """Delete the blocks under ``keys``; returns how many there were. More keys than one
        request carries go in several, each all or nothing. ``descendants``: every block the
        daemon knows to chain below them too; ``tenant``: another tenant's (admin token)."""
        deleted = 0
        with self._lock:
            # The daemon runs a connection's requests concurrently: a read lease this client
            # gave back by a posted release must be gone first, or its blocks count as being
            # read and the delete is refused.
            self._settle()
            self._settle_posts()
            for batch in self._key_batches(keys):
                meta = {"op": "delete", "keys": self._keys_blob(batch), "descendants": descendants}
                deleted += int(self._call_locked(_named(meta, tenant))[0]["num_deleted"])
        return deleted

    def pin(self, keys: Sequence[bytes], *, ttl_s: float | None = None, tenant: str | None = None) -> None:
        """Protect blocks from eviction while this connection lives (or until unpin), and
        with ``ttl_s`` no longer than that. ``tenant``: another tenant's (admin token)."""
        ttl = check_ttl(ttl_s)
        for batch in self._key_batches(keys):
            self._call(_named({"op": "pin", "keys": self._keys_blob(batch), "ttl_s": ttl}, tenant))

    def unpin(self, keys: Sequence[bytes], *, tenant: str | None = None) -> None:
        """Undo this connection's most recent pin of each key."""
        for batch in self._key_batches(keys):
            self._call(_named({"op": "unpin", "keys": self._keys_blob(batch)}, tenant))

    def _with_timeout(self, timeout: float) -> contextlib.AbstractContextManager[None]:
        return socket_timeout(self._sock, timeout)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier of this namespace, as TieredStore.stats()."""
        return dict(self._call({"op": "stats"})[0]["tiers"])

    def daemon_stats(self) -> dict[str, Any]:
        """stats() plus this tenant's counters in this namespace."""
        return self._call({"op": "stats"})[0]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until this client's puts are published to every client of the daemon (a
        shared-memory put returns once its commit is sent; this client's own later requests
        already see it). True when done; the socket's timeout bounds the wait (``timeout`` is
        accepted for TieredStore.flush's signature)."""
        with self._lock:
            self._settle()
        return True

    def close(self) -> None:
        """End the connection. Once it returns the daemon has ended it too (or did not answer
        within ``CLOSE_WAIT_S``): this connection's pins and leases are released, and it no
        longer counts against the daemon's ``max_connections``."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._copier.close()
        with self._lock, contextlib.suppress(OSError):
            try:
                self._settle()  # the last put's commit must land before its leases end with us
            except (RemoteError, KeyError, CapacityError, LayoutMismatchError) as exc:  # lost either way
                log.warning("the last shared-memory put was not stored: %s", exc)
            finally:
                self._sock.sendall(self._touch_frame())
            self._sock.shutdown(socket.SHUT_WR)
            self._wait_for_daemon_close()
        self._pool = self._payloads = None
        self._generations = None
        self._sock.close()

    def abort(self) -> None:
        """Drop the connection at once, without a word to the daemon: for a connection that
        failed or timed out, where ``close`` could wait on a daemon that does not answer. The
        daemon ends its pins and leases when it sees the connection go."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        self._copier.close()
        self._pool = self._payloads = None
        self._generations = None
        with contextlib.suppress(OSError):
            self._sock.close()

    def _wait_for_daemon_close(self) -> None:
        """Read (and drop) what the daemon still sends, up to its close: it serves what it was
        sent, ends the connection's pins and leases, then closes its side."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            self._sock.settimeout(left)
            if not self._sock.recv(1 << 16):
                return

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def parse_address(url: str) -> tuple[str, Any]:
    """``("unix", path)`` or ``("tcp", (host, port))`` of a daemon address.

    Everything after ``unix://`` is the socket's path, so ``unix:///abs/kv.sock`` is absolute
    and ``unix://.kvstore/kvstore.sock`` is relative to the working directory.
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


_UNREACHABLE: dict[type[OSError], type[OSError]] = {}


def _unreachable(exc: OSError, url: str, tried: str) -> OSError:
    """``exc`` again, naming what was tried: of its own type (``FileNotFoundError``...) and
    a ``DaemonUnreachableError``, so a caller may catch either."""
    kind = _UNREACHABLE.get(type(exc))
    if kind is None:
        kind = _UNREACHABLE[type(exc)] = type(type(exc).__name__, (type(exc), DaemonUnreachableError), {})
    message = f"no kvstore daemon answers at {url!r} (tried {tried}): {exc.strerror or exc}; " \
              "is `kvstore serve` running?"
    return kind(exc.errno, message) if exc.errno is not None else kind(message)


def _named(meta: dict[str, Any], tenant: str | None) -> dict[str, Any]:
    """``meta`` acting on ``tenant`` (the admin's choice), or on the connection's own."""
    if tenant is not None:
        meta["tenant"] = tenant
    return meta


def _same_prefix(now: list[int], want: list[int]) -> int:
    """How many leading entries of ``now`` equal those of ``want``."""
    if now == want:
        return len(now)
    n = 0
    for a, b in zip(now, want, strict=False):
        if a != b:
            break
        n += 1
    return n


def _as_exception(code: int, message: str) -> Exception:
    if code == Code.NOT_FOUND:
        return KeyError(message)
    if code == Code.CAPACITY:
        return CapacityError(message)
    if code == Code.LAYOUT:
        return LayoutMismatchError(message)
    if code == Code.BAD_REQUEST:
        return RemoteBadRequest(code, message)
    return RemoteError(code, message)


def _implements_the_contract(store: StoreClient) -> BlockStore:
    return store  # mypy checks that StoreClient is a BlockStore, signature by signature
