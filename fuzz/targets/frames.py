"""The daemon's frame reader and every op of the block protocol, driven as one connection
drives them (kvstore/services/daemon/connection.py), over a real Registry, Leases and
Dispatcher built as server.py builds them (no sockets, no event loop).

Input: one byte picks how the stream arrives (the size of each read: all at once, 1, 3, 8,
61 or 509 bytes), the rest is everything one client sends on one connection: frames, as
``kvstore.protocol.encode`` writes them, of any op. Each input is a fresh connection
(``Session``, the next conn id) of a daemon whose host tier holds 16 blocks (its only tier),
so puts evict. The reader's staging buffer is cut to ``STAGING`` bytes so that small inputs
reach its in-place path for large metas. What must hold:

- a frame whose meta does not decode is BAD_FRAME, a header over the cap TOO_LARGE (the
  connection closes), and every other frame's reply is a map with the request's ``id`` (an
  integer; None for one of another type) and either the op's fields or an ``error`` whose
  code is a ``Code`` other than INTERNAL (the dispatcher's ``errors`` never count one);
- every reply encodes, and fits ``max_frame`` with its data (what ReplyWriter asserts and
  the client's reader refuses past);
- replies agree with their requests: a lookup's run and tiers, an exists per key, a put's
  count, a get's data of ``num_blocks`` blocks, each the bytes this connection put under
  its key (when it put the key absent, once in its request);
- once the connection ends as the daemon ends it (a half-received put's slots given back,
  its leases and pins ended), every namespace passes ``check_integrity`` with no pin, no
  reader and no reserved host slot left, and no lease is live.

An input that opened a namespace besides the seeds' gets a fresh daemon after it, so the
seeds' namespace always has its slot.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.protocol import HEADER, VERSION, Code, ProtocolError, encode, layout_to_dict
from kvstore.services.common.tokens import Tokens
from kvstore.services.daemon import frames
from kvstore.services.daemon.config import DEFAULT_STORE, DaemonConfig
from kvstore.services.daemon.dispatch import Data, Dispatcher
from kvstore.services.daemon.frames import DATA, HEAD, META, FrameReader
from kvstore.services.daemon.host_slots import HeldBlocks, ReservedPut
from kvstore.services.daemon.op_context import OpContext
from kvstore.services.daemon.registry import Registry
from kvstore.services.daemon.session import Session
from kvstore.services.daemon.shm import Leases, leases_per_connection
from kvstore.store import TieredStore

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)  # 512 B blocks
MODEL = "fuzz-model"
MAIN_NAMESPACE = Namespace(MODEL, LAYOUT, "sha256").id
KEY_BYTES = 32
SLOT = 4096  # the host slot of a 512-byte block
NUM_NAMESPACES = 2
MAX_FRAME = 16 << 10  # 28 blocks a put
STAGING = 1 << 10
CHUNKS = (1 << 20, 1, 3, 8, 61, 509)  # bytes per read, picked by the input's first byte
PREFETCH_WAIT_S = 10.0


def _config(data_dir: str) -> DaemonConfig:
    # host RAM only: a disk tier's synced writes made every input six times slower
    settings = replace(DEFAULT_STORE, host_bytes=NUM_NAMESPACES * 16 * SLOT, disk_bytes=0)
    return DaemonConfig(data_dir=Path(data_dir), store_settings=settings, socket_path=f"{data_dir}/s", listen="",
                        http="", max_namespaces=NUM_NAMESPACES, max_frame=MAX_FRAME)


class _Daemon:
    """The daemon's parts, as server.Daemon builds them, over a temporary data directory."""

    def __init__(self) -> None:
        self.data_dir = tempfile.mkdtemp(prefix="kvstore-fuzz-frames-")
        self.config = _config(self.data_dir)
        self.registry = Registry(self.config, Tokens(self.config.token, self.config.tokens_file))
        self.ops = Dispatcher(OpContext(self.config, self.registry, self._leases()))
        self.num_conns = 0

    def _leases(self) -> Leases:
        return Leases(self.config.lease_s, max_per_conn=leases_per_connection(self.config.max_inflight))

    def connect(self) -> _Connection:
        # A connection's leases all end with it: fresh Leases only restart their ids at 1,
        # so that an input's commit can name the lease its reserve was granted.
        self.ops.context.leases = self._leases()
        self.num_conns += 1
        return _Connection(self, self.num_conns)

    def check_quiet(self) -> None:
        """Nothing of an ended connection is left: no lease, and in every namespace no pin,
        reader or reserved slot, and an index that agrees with the tiers."""
        assert len(self.ops.context.leases) == 0, f"{len(self.ops.context.leases)} leases outlived their connection"
        for state in self.registry.namespaces():
            state.store.check_integrity()
            _check_released(state.store)
        assert "INTERNAL" not in self.ops.errors, f"INTERNAL error frames: {self.ops.errors}"

    def is_fresh_needed(self) -> bool:
        return any(state.id != MAIN_NAMESPACE for state in self.registry.namespaces())

    def close(self) -> None:
        self.registry.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)


def _check_released(store: TieredStore) -> None:
    cascade = store._cascade  # the harness reads the index to see that nothing is left held
    assert cascade.reservations.num_reserved == 0, f"{cascade.reservations.num_reserved} host slots left reserved"
    for entry in cascade.index.entries.values():
        assert entry.pins == 0 and entry.readers == 0, (
            f"block {entry.key.hex()}: {entry.pins} pins, {entry.readers} readers after its connection ended")


class _Connection:
    """One connection's receive loop, as connection.Connection runs it, one request at a time."""

    def __init__(self, daemon: _Daemon, conn_id: int) -> None:
        self.daemon = daemon
        self.ops = daemon.ops
        self.session = Session(conn_id, "unix")
        self.reader = FrameReader(daemon.config.max_frame)
        self.closed = False
        self.put_bytes: dict[bytes, bytes] = {}  # key as sent -> the block this connection put

    def feed(self, stream: memoryview, chunk: int) -> None:
        """The socket's bytes, ``chunk`` at a time (buffer_updated)."""
        pos = 0
        while pos < len(stream) and not self.closed:
            buf = self.reader.buffer()
            n = min(len(buf), chunk, len(stream) - pos)
            buf[:n] = stream[pos : pos + n]
            pos += n
            frame = self.reader.received(n)
            if frame is not None:
                self.dispatch(*frame)
            elif self.reader.receiving:
                continue
            self.advance()

    def advance(self) -> None:
        reader = self.reader
        while not self.closed and not reader.receiving:
            if reader.state == HEAD:
                header = reader.read_header()
                if header is False:
                    break
                if isinstance(header, ProtocolError):  # out of step: an error frame, then closed
                    assert header.code == Code.TOO_LARGE, header
                    self.ops.errors[header.code.name] += 1
                    self.closed = True
            elif reader.state == META:
                if not reader.read_meta():
                    break
            else:
                assert reader.state == DATA
                self.receive_data()

    def receive_data(self) -> None:
        reader, meta = self.reader, self.reader.meta
        if reader.data_len == 0:
            self.dispatch(*reader.take(b""))
            return
        body: bytearray | ReservedPut | None = None
        if isinstance(meta, dict) and meta.get("op") == "put" and self.session.principal is not None:
            body = self.ops.reserve_put(self.session, meta, reader.data_len, blocking=False)
            if body is None:  # the worker's try
                body = self.ops.reserve_put(self.session, meta, reader.data_len)
        frame = reader.fill(body if body is not None else bytearray(reader.data_len))
        if frame is not None:
            self.dispatch(*frame)

    def dispatch(self, meta: dict[str, Any] | ProtocolError, data: Data) -> None:
        if isinstance(meta, ProtocolError):
            assert meta.code == Code.BAD_FRAME, meta
            assert not isinstance(data, ReservedPut), "slots reserved for a frame whose meta did not decode"
            self.ops.errors[meta.code.name] += 1
            return
        sent = _data_bytes(data)
        before = self._held(meta)
        reply = self.ops.handle_now(self.session, meta, data)
        if reply is None:
            reply = self.ops.handle(self.session, meta, data)
        out, payload = reply
        try:
            self.check_reply(meta, out, payload, sent, before)
        finally:
            if isinstance(payload, HeldBlocks) and not payload.let_go:  # written: the connection lets go
                payload.let_go = True
                payload.release()
        assert "INTERNAL" not in self.ops.errors, f"INTERNAL error frame for {meta.get('op')!r}: {out}"

    def _held(self, meta: dict[str, Any]) -> list[bool] | None:
        """Before a put: which of its keys the store holds (a held key's put only refreshes)."""
        state, principal = self.session.state, self.session.principal
        keys = meta.get("keys")
        if meta.get("op") != "put" or state is None or principal is None or not isinstance(keys, bytes) \
                or len(keys) % KEY_BYTES:
            return None
        return state.store.contains(state.scope(principal.tenant, _split(keys)))

    def check_reply(self, meta: dict[str, Any], out: Any, payload: Any, sent: bytes | None,
                    before: list[bool] | None) -> None:
        assert isinstance(out, dict) and "id" in out, f"reply without an id: {out!r}"
        rid = meta.get("id")
        assert out["id"] == (rid if isinstance(rid, int) and not isinstance(rid, bool) else None), (
            f"reply id {out['id']!r} for request id {rid!r}")
        head = encode(out, len(payload))  # what ReplyWriter writes
        assert len(head) - HEADER.size + len(payload) <= MAX_FRAME, (
            f"{meta.get('op')!r} reply of {len(head) - HEADER.size} + {len(payload)} bytes exceeds max_frame {MAX_FRAME}")
        if "error" in out:
            assert set(out) == {"id", "error"} and not len(payload), f"error frame with more: {out!r}"
            code = out["error"]["code"]
            assert code in Code._value2member_map_ and code != Code.INTERNAL, f"error frame {out!r}"
            assert isinstance(out["error"]["message"], str)
            return
        op, keys = meta["op"], meta.get("keys")
        key_list = _split(keys) if isinstance(keys, bytes) else []
        if op == "lookup":
            assert 0 <= out["num_blocks"] <= len(key_list) and len(out["tiers"]) == out["num_blocks"], out
        elif op == "exists":
            assert len(out["found"]) == len(key_list), out
        elif op == "put":
            assert out["num_blocks"] == len(key_list), out
            self._note_put(key_list, sent, before)
        elif op == "commit":
            self.put_bytes.clear()  # slots the client wrote (here: whatever they held) under its keys
        elif op == "get" and "lease" not in out:
            self._check_get(key_list, out, payload)

    def _note_put(self, keys: list[bytes], sent: bytes | None, before: list[bool] | None) -> None:
        state = self.session.state
        if sent is None or before is None or state is None:
            return
        size = state.layout.bytes_per_block
        for i, key in enumerate(keys):
            if not before[i] and keys.count(key) == 1:
                self.put_bytes[key] = sent[i * size : (i + 1) * size]

    def _check_get(self, keys: list[bytes], out: dict[str, Any], payload: Any) -> None:
        state = self.session.state
        assert state is not None
        n, size = out["num_blocks"], state.layout.bytes_per_block
        assert 0 <= n <= len(keys) and len(out["tiers"]) == n, out
        assert len(payload) == n * size, f"get of {n} blocks carried {len(payload)} bytes"
        got = _data_bytes(payload)
        assert got is not None
        for i, key in enumerate(keys[:n]):
            want = self.put_bytes.get(key)
            assert want is None or got[i * size : (i + 1) * size] == want, (
                f"get returned other bytes for block {i} ({key.hex()[:16]}) than were put")

    def end(self) -> None:
        """The connection closed: as connection_lost and Daemon.end_session end it."""
        reserved = self.reader.abandon()
        if reserved is not None:
            self.ops.cancel_put(reserved)
        for handle in list(self.session.prefetches.values()):  # settled before the integrity check
            with contextlib.suppress(KVStoreError):  # prefetch_status would answer it as an error frame
                assert handle.wait(PREFETCH_WAIT_S), "a prefetch did not finish"
        self.ops.context.leases.drop_connection(self.session.conn_id)
        self.session.unpin_all()


def _split(keys: bytes) -> list[bytes]:
    return [keys[i : i + KEY_BYTES] for i in range(0, len(keys) - len(keys) % KEY_BYTES, KEY_BYTES)]


def _data_bytes(data: Any) -> bytes | None:
    if isinstance(data, (ReservedPut, HeldBlocks)):
        return b"".join(bytes(v) for v in data.views)
    return bytes(data) if data is not None else None


def make() -> Callable[[bytes], None]:
    frames.STAGING = STAGING  # FrameReader reads it when built and when it slides
    daemon = _Daemon()
    atexit.register(lambda: daemon.close())  # the daemon of the moment: inputs may replace it

    def check(data: bytes) -> None:
        nonlocal daemon
        if not data:
            return
        conn = daemon.connect()
        try:
            conn.feed(memoryview(data)[1:], CHUNKS[data[0] % len(CHUNKS)])
        finally:
            conn.end()
        daemon.check_quiet()
        if daemon.is_fresh_needed():
            daemon.close()
            daemon = _Daemon()

    return check


# ----------------------------------------------------------------------------------- seeds


def _keys(tag: str, n: int) -> bytes:
    return b"".join(hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n))


def _blocks(n: int, seed: int = 0) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return bytes(torch.randn((n, *LAYOUT.block_shape), generator=gen).to(LAYOUT.dtype).view(torch.uint8).flatten().numpy())


def _stream(*requests: dict[str, Any] | tuple[dict[str, Any], bytes], chunk: int = 0) -> bytes:
    """The chunk byte, then hello and ``requests`` (a meta, or a meta and its data), ids 1, 2..."""
    out = [bytes([chunk])]
    hello = {"op": "hello", "version": VERSION, "token": None, "model_id": MODEL, "layout": layout_to_dict(LAYOUT),
             "hash_algo": "sha256", "shm": True}
    for i, req in enumerate((hello, *requests), start=1):
        meta, data = req if isinstance(req, tuple) else (req, b"")
        out += [encode({**meta, "id": i}, len(data)), data]
    return b"".join(out)


def seeds() -> dict[str, bytes]:
    """Hello, then one request of each op; then a few conversations: put and get, put and
    manage, shared-memory reads and writes, eviction, bad frames, a large meta."""
    k3, k20 = _keys("a", 3), _keys("b", 20)
    put3 = ({"op": "put", "keys": k3}, _blocks(3))
    single = {
        "hello": _stream(),
        "lookup": _stream({"op": "lookup", "keys": k3}),
        "put": _stream(put3),
        "get": _stream({"op": "get", "keys": k3}),
        "exists": _stream({"op": "exists", "keys": k3}),
        "pin": _stream({"op": "pin", "keys": k3, "ttl_s": 30.0}),
        "unpin": _stream({"op": "unpin", "keys": k3}),
        "delete": _stream({"op": "delete", "keys": k3, "descendants": True}),
        "stats": _stream({"op": "stats"}),
        "reserve": _stream({"op": "reserve", "keys": k3, "reserve": 2}),
        "commit": _stream({"op": "reserve", "keys": k3}, {"op": "commit", "lease": 1, "keys": k3, "reserve": 3}),
        "release": _stream({"op": "release", "lease": 1, "kind": "write"}),
        "touch": _stream({"op": "touch", "keys": k3, "noreply": True}),
        "prefetch": _stream({"op": "prefetch", "keys": k3}),
        "prefetch_status": _stream({"op": "prefetch", "keys": k3}, {"op": "prefetch_status", "prefetch": 1,
                                                                     "wait_s": 1.0}),
        "inspect": _stream({"op": "inspect", "keys": k3}),
        "forget": _stream({"op": "forget"}),
        "cool": _stream({"op": "cool", "keys": k3}),
    }
    conversations = {
        "put-get": _stream(put3, {"op": "get", "keys": k3}),
        "put-get-bytewise": _stream(put3, {"op": "get", "keys": k3}, chunk=1),
        "put-get-chunks": _stream(put3, {"op": "lookup", "keys": k3}, {"op": "get", "keys": k3}, chunk=4),
        "put-manage": _stream(put3, {"op": "pin", "keys": k3}, {"op": "inspect", "keys": k3},
                              {"op": "delete", "keys": k3}, {"op": "unpin", "keys": k3},
                              {"op": "cool", "keys": k3}, {"op": "delete", "keys": k3}, {"op": "lookup", "keys": k3}),
        "put-pin-forget": _stream(put3, {"op": "pin", "keys": k3}, {"op": "forget"}, {"op": "exists", "keys": k3}),
        "shm-get-release": _stream(put3, {"op": "get", "keys": k3, "shm": True}, {"op": "touch", "keys": k3},
                                   {"op": "release", "lease": 1}),
        "shm-reserve-commit": _stream({"op": "reserve", "keys": k3, "reserve": 3},
                                      {"op": "commit", "lease": 1, "reserve": 3, "group": 0},
                                      {"op": "commit", "lease": 2, "keys": k3}, {"op": "get", "keys": k3}),
        "evict": _stream(({"op": "put", "keys": k20}, _blocks(20, 1)), put3, {"op": "lookup", "keys": k20[::-1]},
                         {"op": "prefetch", "keys": k20}, {"op": "get", "keys": k20[: 8 * KEY_BYTES]},
                         {"op": "prefetch_status", "prefetch": 1, "wait_s": 2}),
        "large-meta": _stream({"op": "lookup", "keys": _keys("c", 40)}, {"op": "exists", "keys": _keys("c", 40)},
                              chunk=5),
        "bad-frames": _stream(({"op": "put", "keys": k3[:40]}, b"x" * 7), {"op": "nope"}, {"op": "hello"})
        + HEADER.pack(2, 0) + b"\x91\xc1" + encode({"op": "stats", "id": 9}),
        "before-hello": bytes([0]) + encode({"op": "get", "id": 1, "keys": k3}) + encode({"op": "hello", "version": 2}),
        "too-large": _stream({"op": "stats"}) + (MAX_FRAME).to_bytes(4, "big") + bytes(4),
        "hello-twice": _stream({"op": "hello", "version": VERSION, "model_id": "other", "layout": layout_to_dict(LAYOUT)}),
        "other-namespace": bytes([0]) + encode({"op": "hello", "version": VERSION, "model_id": "another-model",
                                                "layout": layout_to_dict(replace(LAYOUT, head_dim=16)), "id": 1})
        + encode({"op": "put", "keys": k3, "id": 2}, 3 * 1024) + _blocks(6),
    }
    return {**single, **conversations}
