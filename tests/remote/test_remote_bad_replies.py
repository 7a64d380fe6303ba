"""A server that answers what no Redis answers (the fuzz harness remote_replies found each of
these): every call of the tier still returns, each failure counted, never raised.

The server here is a real TCP server on 127.0.0.1 that answers each request with the next
scripted bytes, read by the tier's real redis-py connections.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MovedError, ResponseError

from kvstore.tiers.remote import RemoteTier
from kvstore.tiers.remote.deadline import DeadlineConnection
from kvstore.tiers.remote.replies import GetReplies, ProtocolError, Reply
from kvstore.tiers.remote.slot_map import NUM_SLOTS, parse_slots

from remote_helpers import LAYOUT_ID, PAYLOAD, keys, payloads

Script = list[tuple[int, bytes]]  # (commands in the request, the answer)


def _command(buf: bytes) -> tuple[list[bytes], bytes] | None:
    """The first RESP command of ``buf`` and what follows it; None while it is incomplete."""
    end = buf.find(b"\r\n")
    if end < 0:
        return None
    count, pos, args = int(buf[1:end]), end + 2, []
    for _ in range(count):
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return None
        start = end + 2
        length = int(buf[pos + 1 : end])
        if len(buf) < start + length + 2:
            return None
        args.append(buf[start : start + length])
        pos = start + length + 2
    return args, buf[pos:]


class LyingServer:
    """Answers each request of ``n`` commands with the script's next bytes, in order over all
    connections; ``requests`` keeps the commands it was sent."""

    def __init__(self, script: Script) -> None:
        self.script = deque(script)
        self.requests: list[list[list[bytes]]] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while self.script:
                n, answer = self.script[0]
                commands: list[list[bytes]] = []
                while len(commands) < n:
                    parsed = _command(buf)
                    if parsed is None:
                        data = conn.recv(1 << 16)
                        if not data:
                            return
                        buf += data
                        continue
                    command, buf = parsed
                    commands.append(command)
                self.script.popleft()
                self.requests.append(commands)
                conn.sendall(answer)

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def lying() -> Iterator[Callable[..., tuple[LyingServer, RemoteTier]]]:
    made: list[tuple[LyingServer, RemoteTier]] = []

    def start(script: Script, cluster: bool = False, **kwargs: object) -> tuple[LyingServer, RemoteTier]:
        server = LyingServer(script)
        url = f"redis{'+cluster' if cluster else ''}://127.0.0.1:{server.port}"
        kwargs.setdefault("timeout_s", 2.0)
        made.append((server, RemoteTier(url, PAYLOAD, LAYOUT_ID, **kwargs)))  # type: ignore[arg-type]
        return made[-1]

    yield start
    for server, tier in made:
        tier.close(0)
        server.close()


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def _slots(host: bytes, port: int, first: int = 0, last: int = NUM_SLOTS - 1) -> bytes:
    """CLUSTER SLOTS as Redis 7 answers it in RESP2: one range, its primary."""
    return (b"*1\r\n*3\r\n:%d\r\n:%d\r\n*4\r\n$%d\r\n%s\r\n:%d\r\n$2\r\nid\r\n*0\r\n"
            % (first, last, len(host), host, port))


# ----------------------------------------------------------------------------- CLUSTER SLOTS


@pytest.mark.parametrize("reply", [
    [[0, 16383, [b"12\xd0.0.0.1", 7000]]],  # a host that is not UTF-8
    [[0, NUM_SLOTS, [b"127.0.0.1", 7000]]],  # one slot past the last
    [[-5, 10, [b"127.0.0.1", 7000]]],  # (a slice from -5 would grow the map)
    [[10, 5, [b"127.0.0.1", 7000]]],
    [[0, 16383, [b"127.0.0.1", 0]]],
    [[0, 16383, [b"127.0.0.1", b"7000"]]],
    [[0, 16383]],
    [[0, 16383, b"127.0.0.1"]],
    [7],
    b"OK",
])
def test_a_cluster_slots_reply_no_redis_gives_is_a_value_error(reply: object) -> None:
    with pytest.raises(ValueError, match="CLUSTER SLOTS"):
        parse_slots(reply, ("seed", 7000))
    slots, named = parse_slots([[0, 16383, [b"", 7001, b"id", []]]], ("seed", 7000))
    assert len(slots) == NUM_SLOTS and set(slots) == {("seed", 7001)} and named == [("seed", 7001)]


def test_a_seed_with_a_garbled_slot_map_is_passed_over_for_the_next() -> None:
    k = keys("slots", 1)
    bad, good = LyingServer([(1, _slots(b"12\xd0.0.0.1", 7000))]), LyingServer([])
    tier = RemoteTier(f"redis+cluster://127.0.0.1:{bad.port},127.0.0.1:{good.port}", PAYLOAD, LAYOUT_ID, timeout_s=2.0)
    try:
        value = tier.encode(k, list(payloads(k)))[0].value
        good.script.extend([(1, _slots(b"127.0.0.1", good.port)), (1, _bulk(value))])
        out = bytearray(PAYLOAD)
        assert tier.get(k, [out]) == [True] and bytes(out) == payloads(k)[0].tobytes()
        assert bad.requests == [[[b"CLUSTER", b"SLOTS"]]]
    finally:
        tier.close(0)
        bad.close()
        good.close()


def test_a_host_name_no_resolver_takes_is_a_connection_error() -> None:
    """As a MOVED, an ASK or a slot map may name it: redis-py counts only OSError as a failed
    connect, and IDNA's refusal ("a..b") is a UnicodeError."""
    with pytest.raises(RedisConnectionError, match=r"cannot resolve host 'a\.\.b'"):
        DeadlineConnection(host="a..b", port=7000, socket_connect_timeout=1.0).connect()


# ----------------------------------------------------------------------------- GET's reader


def _read(stream: bytes, n: int) -> list[Reply]:
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(stream)
        theirs.shutdown(socket.SHUT_WR)
        views = memoryview(bytearray(8 * n))
        return GetReplies(ours).read(n, 8, lambda i: views[8 * i : 8 * i + 8])
    finally:
        ours.close()
        theirs.close()


def test_get_replies_bound_blob_errors_and_read_garbled_redirections_as_errors() -> None:
    for stream in (b"!-5\r\n", b"!99999999999\r\n"):  # bytearray(-5) was a ValueError, the other a MemoryError
        with pytest.raises(ProtocolError, match="blob error"):
            _read(stream, 1)
    moved, ask, real = _read(b"-MOVED garbage\r\n-ASK 12\r\n-MOVED 12 127.0.0.1:7001\r\n", 3)
    assert type(moved) is ResponseError and str(moved) == "MOVED garbage"  # redis-py's own raised ValueError
    assert type(ask) is ResponseError and isinstance(real, MovedError) and real.port == 7001


# ----------------------------------------------------------------------------- the tier's calls


def test_replies_redis_py_cannot_read_are_counted_failures(lying: Callable[..., tuple]) -> None:
    k = keys("unreadable", 1)
    _, tier = lying([(1, b"-MOVED garbage\r\n")])  # redis-py's parser raised ValueError for this
    assert tier.contains(k) == [False]
    assert tier.stats()["errors_connection"] == 1


def test_a_put_whose_exists_answer_no_redis_gives_drops_the_block(lying: Callable[..., tuple]) -> None:
    k = keys("exists5", 1)
    _, tier = lying([(1, b":5\r\n")])
    assert tier.put(k, payloads(k)) == 0
    s = tier.stats()
    assert s["dropped"] == 1 and s["skipped"] == 0 and s["bytes_written"] == 0


@pytest.mark.parametrize(("answer", "error"), [
    (_bulk(b"used_memory:abc\r\n") + _bulk(b"") + b":1\r\n", "unreadable INFO or DBSIZE"),
    (_bulk(b"used_memory:1.0e999\r\n") + _bulk(b"") + b":1\r\n", "unreadable INFO or DBSIZE"),  # int(inf)
    (_bulk(b"used_memory:1\r\n") + _bulk(b"") + _bulk(b"many"), "unreadable INFO or DBSIZE"),
    (b":5\r\n:5\r\n:5\r\n", "ProtocolError"),  # redis-py's INFO callback raised AttributeError on an int
])
def test_node_info_no_redis_gives_is_a_node_down(lying: Callable[..., tuple], answer: bytes, error: str) -> None:
    _, tier = lying([(3, answer)])
    (node,) = tier.nodes()
    assert not node.up and error in node.error
    assert tier.stats()["nodes_up"] == 0


@pytest.mark.parametrize("scan", [b"*2\r\n$3\r\nabc\r\n*0\r\n", b":1\r\n", b"*1\r\n$1\r\n0\r\n"])
def test_a_sweep_answered_by_a_scan_no_redis_gives_names_the_node(lying: Callable[..., tuple], scan: bytes) -> None:
    server, tier = lying([(1, scan)])
    result = tier.forget_owner(b"o" * 16, flush_timeout=1.0)
    assert not result.complete and result.failed[0].startswith(f"127.0.0.1:{server.port}: ")


def test_a_probe_answered_by_garbage_opens_the_circuit_again(lying: Callable[..., tuple]) -> None:
    """The probe used to raise out of its pool thread, leaving the breaker half-open and
    probing for good: the node was never asked again."""
    server, tier = lying([(1, b"-MOVED garbage\r\n")], breaker_threshold=1, breaker_cooldown_s=0.2)
    node = ("127.0.0.1", server.port)
    breaker = tier._topology.breaker(node)
    breaker.failure()
    time.sleep(0.25)  # the cool-down under test
    assert breaker.should_probe()
    tier._topology._probe(node)
    assert breaker.num_opened == 2 and server.requests == [[[b"PING"]]]
