"""Hostile input on the block protocol: every bad frame gets an error frame or a closed
connection, the daemon keeps serving others, and its memory stays bounded."""

from __future__ import annotations

import random
import select
import socket
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from kvstore.protocol import HEADER, VERSION, Code, encode, layout_to_dict

from daemon_helpers import LAYOUT, DaemonProc, blocks, daemon_fixture, prompt, shared_daemon_fixture  # noqa: F401
from waiting import wait_until

HELLO = {"op": "hello", "version": VERSION, "model_id": "test-model", "layout": layout_to_dict(LAYOUT)}


def raw(d: DaemonProc) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(d.unix[len("unix://"):])
    return s


def reply(s: socket.socket) -> dict[str, Any] | None:
    """The next frame's meta, or None when the daemon closed the connection."""
    try:
        head = s.recv(HEADER.size, socket.MSG_WAITALL)
        if len(head) < HEADER.size:
            return None
        meta_len, data_len = HEADER.unpack(head)
        meta = msgpack.unpackb(s.recv(meta_len, socket.MSG_WAITALL))
        if data_len:
            s.recv(data_len, socket.MSG_WAITALL)
        return meta
    except ConnectionResetError:
        return None


def frame(meta_bytes: bytes, data: bytes = b"") -> bytes:
    return HEADER.pack(len(meta_bytes), len(data)) + meta_bytes + data


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def code_of(meta: dict[str, Any] | None) -> int | None:
    return None if meta is None else meta.get("error", {}).get("code")


def assert_serving(d: DaemonProc) -> None:
    with d.connect() as c:
        keys = c.block_keys(prompt(777, 2))
        c.put(keys, blocks(keys))
        assert torch.equal(c.get(keys), blocks(keys))


def test_error_frames_for_bad_requests(shared_daemon: DaemonProc) -> None:
    s = raw(shared_daemon)
    s.sendall(encode({"op": "lookup", "id": 1, "keys": b""}))
    assert code_of(reply(s)) == Code.STATE  # before hello
    s.sendall(encode({**HELLO, "version": 99}))
    assert code_of(reply(s)) == Code.VERSION
    s.sendall(encode({**HELLO, "layout": {"num_layers": "two"}}))
    assert code_of(reply(s)) == Code.LAYOUT
    s.sendall(encode({**HELLO, "layout": [1, 2]}))
    assert code_of(reply(s)) == Code.BAD_REQUEST
    s.sendall(encode(HELLO))
    assert reply(s)["tenant"] == ""  # type: ignore[index]
    cases = [
        ({"op": "lookup", "keys": "not bytes"}, Code.BAD_REQUEST),
        ({"op": "lookup", "keys": b"x" * 31}, Code.BAD_REQUEST),
        ({"op": "lookup"}, Code.BAD_REQUEST),
        ({"op": 5}, Code.BAD_REQUEST),
        ({"op": "frobnicate"}, Code.UNKNOWN_OP),
        ({"op": "hello", **HELLO}, Code.STATE),
        ({"op": "get", "keys": b"k" * 32 * 100_000}, Code.BAD_REQUEST),
        ({"op": "pin", "keys": b"k" * 32}, Code.NOT_FOUND),
        ({"op": "commit", "lease": 12345}, Code.LEASE),
        ({"op": "release", "lease": True}, Code.BAD_REQUEST),
        ({"op": "get", "keys": b"k" * 32, "shm": "yes"}, Code.BAD_REQUEST),
    ]
    for meta, code in cases:
        s.sendall(encode(meta))
        assert code_of(reply(s)) == code, meta
    s.sendall(encode({"op": "put", "keys": b"k" * 64}, 3) + b"abc")  # data does not match the keys
    assert code_of(reply(s)) == Code.BAD_REQUEST
    for body in [msgpack.packb([1, 2, 3]), b"\xc1", msgpack.packb(msgpack.ExtType(5, b"x")),
                 b"[" * 10, b"\x91" * 100_000, msgpack.packb({1: 2}), b""]:
        s.sendall(frame(body))
        assert code_of(reply(s)) == Code.BAD_FRAME, body[:20]
    s.sendall(encode({"op": "stats"}))  # still in step, still served
    assert "tiers" in reply(s)  # type: ignore[operator]
    s.close()


def test_garbage_truncated_oversized_close_the_connection(shared_daemon: DaemonProc) -> None:
    d = shared_daemon
    before = rss_kib(d.proc.pid)
    for _ in range(50):
        s = raw(d)
        s.sendall(HEADER.pack(1 << 31, 1 << 31))  # 4 GiB claimed: refused before any body read
        assert code_of(reply(s)) == Code.TOO_LARGE
        assert reply(s) is None
        s.close()
    s = raw(d)
    s.sendall(bytes(random.Random(1).getrandbits(8) for _ in range(4096)))
    assert code_of(reply(s)) in (Code.TOO_LARGE, Code.BAD_FRAME, None)
    s.close()
    for cut in (3, 8, 20):  # truncated inside the header, the meta, the data
        s = raw(d)
        s.sendall((encode(HELLO, 4) + b"data")[:cut])
        s.shutdown(socket.SHUT_WR)
        assert reply(s) is None or code_of(reply(s)) is not None
        s.close()
    rng = random.Random(7)
    s = raw(d)
    s.sendall(encode(HELLO))
    reply(s)
    for _ in range(300):  # random bodies inside well-formed frames: one error frame each
        s.sendall(frame(bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64)))))
        assert "error" in reply(s)  # type: ignore[operator]
    s.close()
    assert_serving(d)
    assert rss_kib(d.proc.pid) - before < 64 * 1024


def test_a_client_that_never_reads_cannot_grow_the_daemon(shared_daemon: DaemonProc) -> None:
    d = shared_daemon
    with d.connect() as c:
        keys = c.block_keys(prompt(4242, 60))
        c.put(keys, blocks(keys))
    s = raw(d)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(encode(HELLO))
    reply(s)
    before = rss_kib(d.proc.pid)
    request = encode({"op": "get", "keys": b"".join(keys)})  # ~30 KiB of blocks per response
    s.setblocking(False)
    pending = request * 40_000  # ~77 MB of requests, ~1.2 GB of replies if all were served
    sent = 0
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and sent < len(pending):  # pipeline, never read a reply
        try:
            sent += s.send(pending[sent : sent + (1 << 16)])
        except BlockingIOError:
            select.select([], [s], [], 0.05)  # until the socket takes bytes again (the deadline ends it)
    # the daemon stopped reading: socket buffers plus its 8 MiB input bound, then our sends block
    assert len(request) * 8 < sent < 32 << 20
    assert rss_kib(d.proc.pid) - before < 64 * 1024
    assert_serving(d)
    s.close()


def test_commits_answered_on_the_event_loop_still_stop_a_client_that_never_reads(shared_daemon: DaemonProc) -> None:
    # A commit is served and answered as soon as its frame is parsed (no task). Its replies
    # must still count against the write bound: a client pipelining commits without reading
    # a reply gets the daemon to stop reading it, and the daemon's memory stays bounded.
    d = shared_daemon
    s = raw(d)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(encode(HELLO))
    reply(s)
    before = rss_kib(d.proc.pid)
    request = encode({"op": "commit", "lease": 123456789})  # an unknown lease: an error reply each
    s.setblocking(False)
    pending = request * 2_000_000  # ~60 MB of requests, ~150 MB of error replies if all were served
    sent, stalled_since, stalled = 0, 0.0, False
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # pipeline, never read a reply, until the daemon stops reading
        try:
            sent += s.send(pending[sent : sent + (1 << 16)])
            stalled_since = 0.0
        except BlockingIOError:
            now = time.monotonic()
            stalled_since = stalled_since or now
            if now - stalled_since > 1.0:
                stalled = True
                break
            select.select([], [s], [], 0.02)  # until the socket takes bytes again, if it ever does
    assert stalled, f"the daemon kept reading a client that reads nothing ({sent / 1e6:.0f} MB sent)"
    assert sent < 12e6  # socket buffers and ~1 MiB of unsent replies' worth of frames
    assert rss_kib(d.proc.pid) - before < 64 * 1024
    assert_serving(d)
    s.setblocking(True)
    s.settimeout(10)
    assert code_of(reply(s)) == Code.LEASE  # the replies held back are still there, in order
    s.close()


@pytest.mark.parametrize("depth", [200, 5000])
def test_deeply_nested_frames(shared_daemon: DaemonProc, depth: int) -> None:
    s = raw(shared_daemon)
    body = b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]
    s.sendall(frame(body))
    assert code_of(reply(s)) == Code.BAD_FRAME
    nested_map = b"\x81\xa1a" * depth + b"\xc0"
    s.sendall(frame(nested_map))
    assert code_of(reply(s)) in (Code.BAD_FRAME, Code.BAD_REQUEST)
    s.sendall(encode(HELLO))
    assert "tenant" in reply(s)  # type: ignore[operator]
    s.close()



def test_a_put_cut_off_inside_its_data_gives_its_host_slots_back(daemon: DaemonProc) -> None:
    d = daemon
    with d.connect(shm=False) as c:
        used = c.stats()["host"]["used_bytes"]
        keys = c.block_keys(prompt(9090, 6))
        data = blocks(keys).view(torch.uint8).numpy().tobytes()
        s = raw(d)
        s.sendall(encode(HELLO))
        reply(s)
        s.sendall(encode({"op": "put", "id": 1, "keys": b"".join(keys)}, len(data)) + data[: len(data) // 2])
        wait_until(lambda: c.stats()["host"]["used_bytes"] != used, 10, "the put's host slots reserved")
        assert c.stats()["host"]["used_bytes"] == used + 6 * 4096  # slots reserved, half received
        s.close()
        # the reservation ends with the connection; nothing was published
        wait_until(lambda: c.stats()["host"]["used_bytes"] == used, 5, "the closed put's slots given back")
        assert c.stats()["host"]["used_bytes"] == used
        assert c.lookup(keys).num_blocks == 0
        c.put(keys, blocks(keys))  # received straight into host slots: the same bytes come back
        assert torch.equal(c.get(keys), blocks(keys))
        assert c.stats()["host"]["used_bytes"] == used + 6 * 4096


def test_every_reply_fits_a_small_max_frame(tmp_path: Path) -> None:
    """Found by the frames fuzz harness (fuzz/regressions/frames/): a request's id of another
    type than int was echoed (a binary of nearly max_frame bytes pushed a get's reply past the
    cap), and an inspect of max_keys keys answered rows of ~100 bytes each; either reply failed
    ReplyWriter's cap assertion and never came. Now the id is None, the inspect BAD_REQUEST."""
    config = tmp_path / "daemon.toml"
    config.write_text("max_frame = 16384\n")
    d = DaemonProc(tmp_path / "data", "--config", str(config))
    try:
        with d.connect(shm=False) as c:
            keys = c.block_keys(prompt(4242, 3))
            c.put(keys, blocks(keys))
        s = raw(d)
        s.sendall(encode(HELLO))
        assert reply(s)["max_frame"] == 16384  # type: ignore[index]
        s.sendall(encode({"op": "get", "id": b"x" * 15000, "keys": b"".join(keys)}))
        head = s.recv(HEADER.size, socket.MSG_WAITALL)
        meta_len, data_len = HEADER.unpack(head)
        assert meta_len + data_len <= 16384
        meta = msgpack.unpackb(s.recv(meta_len, socket.MSG_WAITALL))
        assert meta["id"] is None and meta["num_blocks"] == 3
        got = torch.frombuffer(bytearray(s.recv(data_len, socket.MSG_WAITALL)), dtype=LAYOUT.dtype)
        assert torch.equal(got.view(3, *LAYOUT.block_shape), blocks(keys))
        s.sendall(encode({"op": "lookup", "id": "seven", "keys": b"".join(keys)}))
        assert reply(s) == {"id": None, "num_blocks": 3, "tiers": "hhh"}
        s.sendall(encode({"op": "inspect", "id": 8, "keys": keys[0] * 400}))  # ~40 KB of rows
        refused = reply(s)
        assert code_of(refused) == Code.BAD_REQUEST and refused["id"] == 8  # type: ignore[index]
        assert "max_frame" in refused["error"]["message"]  # type: ignore[index]
        s.sendall(encode({"op": "inspect", "id": 9, "keys": b"".join(keys)}))
        rows = reply(s)["blocks"]  # type: ignore[index]
        assert [row["tiers"][0] for row in rows] == ["host"] * 3
        s.close()
    finally:
        d.kill9()
