"""The remote tier's readers of what Redis answers: GET's own reply reader
(kvstore/tiers/remote/replies.py), redis-py's RESP2 parser under the tier's pipelines, the
MOVED/ASK redirections the pipelines follow (topology.py), CLUSTER SLOTS (slot_map.py), INFO
and DBSIZE (info.py), SCAN and GETRANGE of a sweep (sweep.py): a whole ``RemoteTier`` talking
to a server that says whatever the input says.

Input: one byte picks the call (get, a leading get, lookup then get, exists, put, stats,
delete, forget_owner; bits 0-2) and a second call to follow it (bit 3 set: bits 4-6), one the
number of keys (1-4) and whether the URL is a cluster's (then the first answer is CLUSTER
SLOTS), one the most bytes a socket receive returns (0: all there is); the rest is the
server's answers, one per request a connection sends (a pipeline,
a CLUSTER SLOTS, a SCAN), separated by ``SEP``. The connections are redis-py's own, over
in-memory sockets (a socket with no answer left reads as closed); the tier's thread pools run
their work inline, so one input always takes the same path.

The tier is a cache: whatever the server says, no call raises (every failure is a counted
miss or dropped write), and what must hold is:

- a read delivers only the bytes put under each key (a value of the real format, checksum
  included, is all the tier accepts; the seeds serve such values), a leading read only a
  leading run, and hits + misses is the blocks asked for;
- lookup and exists answer 0..n, put answers 0..n and accounts for every block it was given
  (written, skipped as present, or dropped);
- ``errors`` is the sum of the error kinds; stats and node info are ints.
"""

from __future__ import annotations

import hashlib
import socket
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from redis.connection import Connection

from kvstore.tiers.remote import RemoteTier, codec
from kvstore.tiers.remote.deadline import DeadlineConnection, _connect

SEP = b"\n--next--\n"
PAYLOAD = 48
LAYOUT_ID = "L2-H2-D64-B16-float16-tp0of1"
KEYS = tuple(hashlib.sha256(b"block %d" % i).digest() for i in range(4))
OWNER = hashlib.sha256(b"tenant").digest()[: codec.OWNER_BYTES]
CALLS = ("get", "get-leading", "lookup-get", "exists", "put", "stats", "delete", "forget-owner")
SINGLE, CLUSTER = "redis://server.invalid:7000", "redis+cluster://seed.invalid:7000"


def payload_of(key: bytes) -> bytes:
    """The block put under ``key`` (derived from it, so a read of another block's bytes shows)."""
    return hashlib.shake_128(key).digest(PAYLOAD)


class _Server:
    """The answers of one input: each connection that sends after reading (a new request)
    takes the next one."""

    def __init__(self) -> None:
        self.answers: deque[bytes] = deque()
        self.chunk = 0


SERVER = _Server()
_NEVER_READABLE, _PEER = socket.socketpair()  # a descriptor poll() never finds readable: nothing is ever sent to it


class _Socket:
    """A connected socket whose peer answers each request with the server's next answer."""

    def __init__(self) -> None:
        self._pending = b""
        self._sending = False
        self._timeout: float | None = None

    def sendall(self, data: Any, flags: int = 0) -> None:
        if not self._sending:  # a new request: its answer is what the peer sends back
            self._sending = True
            self._pending += SERVER.answers.popleft() if SERVER.answers else b""

    def _take(self, size: int) -> bytes:
        self._sending = False
        if not self._pending:
            if self._timeout == 0:  # redis-py asking whether anything is waiting: nothing is
                raise TimeoutError("timed out")
            return b""  # the peer closed
        n = min(size, SERVER.chunk or size, len(self._pending))
        out, self._pending = self._pending[:n], self._pending[n:]
        return out

    def recv(self, size: int, flags: int = 0) -> bytes:
        return self._take(size)

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        view = memoryview(buffer).cast("B")
        got = self._take(nbytes or len(view))
        view[: len(got)] = got
        return len(got)

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def gettimeout(self) -> float | None:
        return self._timeout

    def pending(self) -> int:  # what redis-py asks of a TLS socket first, before it polls fileno()
        return len(self._pending)

    def fileno(self) -> int:
        return _NEVER_READABLE.fileno()

    def setsockopt(self, *args: Any) -> None:
        pass

    def shutdown(self, how: int) -> None:
        pass

    def close(self) -> None:
        self._pending = b""


class _Connection(DeadlineConnection):
    """The tier's own connection class, over a ``_Socket`` instead of TCP. The host name is
    encoded as ``socket.getaddrinfo`` does first (IDNA), so a name no resolver takes fails
    here as it would there."""

    def _connect(self) -> Any:
        def connect() -> Any:
            self.host.encode("idna")
            return _Socket()

        return _connect(self, connect)


RAISED: list[BaseException] = []


class _Inline:
    """An executor that runs each task at once, on the caller's thread. A task that raises
    is noted in ``RAISED``: a pool's caller may never look (a probe's, a slot map refresh's)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed over as a pool would, and noted
            RAISED.append(exc)
            future.set_exception(exc)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def _tier(url: str) -> RemoteTier:
    # two failures open a node's circuit, and its probe may go out at once: one input reaches
    # the breaker's paths (probes, replicas answering for an open primary)
    tier = RemoteTier(url, PAYLOAD, LAYOUT_ID, timeout_s=30.0, hint_ttl_s=60.0, breaker_threshold=2,
                      breaker_cooldown_s=1e-6)
    tier._topology._pool = _Inline()  # type: ignore[assignment]
    tier._topology.slots._refresher = _Inline()  # type: ignore[assignment]
    return tier


def _reset(tier: RemoteTier) -> None:
    """Forget what the last input left: connections, clients, breakers, hints, the slot map
    and the INFO cache (the tier's counters are compared before and after instead)."""
    topology = tier._topology
    nodes = topology.nodes
    for client in nodes._clients.values():
        client.connection_pool.disconnect()  # (the connections stay in their pools, unconnected)
    if len(nodes._clients) > 64:  # the nodes replies named: kept for speed, within a bound
        nodes._clients.clear()
    nodes._breakers.clear()
    slots = topology.slots
    slots._slots = [None] * len(slots._slots)
    slots._known = list(slots.url.nodes)
    slots._discovered = not slots.url.cluster
    slots._last_refresh = 0.0
    tier.forget_hints()
    tier._info._at = float("-inf")


def _patch_clients(tier: RemoteTier) -> None:
    nodes = tier._topology.nodes
    make = nodes.client

    def client(node: Any, **kwargs: Any) -> Any:
        found = make(node, **kwargs)
        pool = found.connection_pool
        if pool.connection_class is not _Connection:
            pool.connection_class = _Connection
        return found

    nodes.client = client  # type: ignore[method-assign]


def _counts(tier: RemoteTier) -> dict[str, int]:
    return tier.counters.snapshot()


def _call(tier: RemoteTier, call: str, keys: list[bytes]) -> None:
    """One call of the tier, and what must hold of its answer."""
    n = len(keys)
    before = _counts(tier)
    if call in ("get", "get-leading", "lookup-get"):
        if call == "lookup-get":
            found = tier.lookup(keys)
            assert 0 <= found <= n, found
        outs = [bytearray(PAYLOAD) for _ in keys]
        owners: list[bytes | None] = [None] * n
        ok = tier.get(keys, outs, leading=call == "get-leading", owners=owners)
        assert len(ok) == n and all(isinstance(o, bool) for o in ok), ok
        for key, good, out, owner in zip(keys, ok, outs, owners, strict=True):
            if good:
                assert bytes(out) == payload_of(key), "a read delivered bytes never put under its key"
                assert isinstance(owner, bytes) and len(owner) == codec.OWNER_BYTES
            else:
                assert out == bytes(PAYLOAD) and owner is None, "a miss wrote into the caller's memory"
        if call == "get-leading":
            assert ok == sorted(ok, reverse=True), f"a leading read delivered past a miss: {ok}"
        after = _counts(tier)
        assert after["hits"] - before["hits"] == sum(ok)
        assert after["hits"] + after["misses"] - before["hits"] - before["misses"] == n
    elif call == "exists":
        assert 0 <= tier.exists(keys) <= n
    elif call == "put":
        written = tier.put(keys, [payload_of(k) for k in keys], owners=[OWNER] * n)
        after = _counts(tier)
        assert 0 <= written <= n
        dropped, skipped = (after[c] - before[c] for c in ("dropped", "skipped"))
        assert written + dropped + skipped == n, f"{n} blocks put: {written} written, {dropped} dropped, {skipped} skipped"
    elif call == "stats":
        for node in tier.nodes():
            assert all(isinstance(v, (int, str, bool)) for v in node.as_dict().values()), node
        assert all(isinstance(v, int) for v in tier.stats().values())
    elif call == "delete":
        tier.delete(keys)
    else:
        result = tier.forget_owner(OWNER, flush_timeout=1.0)
        assert isinstance(result.deleted, int) and isinstance(result.scanned, int), result
    after = _counts(tier)
    assert after["errors"] == sum(v for k, v in after.items() if k.startswith("errors_"))


def make() -> Callable[[bytes], None]:
    assert issubclass(_Connection, Connection)
    tiers = {False: _tier(SINGLE), True: _tier(CLUSTER)}
    for tier in tiers.values():
        _patch_clients(tier)

    def check(data: bytes) -> None:
        if len(data) < 3:
            return
        calls = [CALLS[data[0] & 0x07]] + ([CALLS[(data[0] >> 4) & 0x07]] if data[0] & 0x08 else [])
        tier = tiers[bool(data[1] & 0x80)]
        SERVER.chunk = data[2]
        SERVER.answers = deque(data[3:].split(SEP))
        _reset(tier)
        RAISED.clear()
        for call in calls:
            _call(tier, call, list(KEYS[: 1 + (data[1] & 0x03)]))
        if RAISED:
            raise AssertionError("a task of the tier's pools raised") from RAISED[0]

    return check


# ----------------------------------------------------------------------------- seeds


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def _array(*items: bytes) -> bytes:
    return b"*%d\r\n" % len(items) + b"".join(items)


def _int(value: int) -> bytes:
    return b":%d\r\n" % value


def _value(key: bytes) -> bytes:
    return codec.encode(key, codec.layout_digest(LAYOUT_ID), memoryview(payload_of(key)), OWNER)


def _slots(*ranges: tuple[int, int, int]) -> bytes:
    """CLUSTER SLOTS as Redis 7 sends it in RESP2: per range its primary and one replica, each
    [ip, port, node id, networking metadata (an empty map: no hostname)]."""
    def node(port: int) -> bytes:
        return _array(_bulk(b"127.0.0.1"), _int(port), _bulk(hashlib.sha1(b"%d" % port).hexdigest().encode()),
                      _array())
    return _array(*(_array(_int(a), _int(b), node(port), node(port + 3)) for a, b, port in ranges))


def seeds() -> dict[str, bytes]:
    """Real answers: values of the real format, nulls, errors, redirections, CLUSTER SLOTS of
    a three-primary cluster, INFO, SCAN pages."""
    def seed(call: str, n: int, *answers: bytes, cluster: bool = False, chunk: int = 0, then: str = "") -> bytes:
        second = 0x08 | CALLS.index(then) << 4 if then else 0
        return bytes([CALLS.index(call) | second, (n - 1) | (0x80 if cluster else 0), chunk]) + SEP.join(answers)

    values = [_bulk(_value(k)) for k in KEYS]
    torn = bytearray(_value(KEYS[1]))
    torn[-1] ^= 0xFF
    slots = _slots((0, 5460, 7000), (5461, 10922, 7001), (10923, 16383, 7002))
    one_slot_map = _slots((0, 16383, 7000))
    info_memory = _bulk(b"# Memory\r\nused_memory:1048576\r\nused_memory_human:1.00M\r\nmaxmemory:25165824\r\n"
                        b"maxmemory_policy:allkeys-lru\r\n")
    info_stats = _bulk(b"# Stats\r\ntotal_connections_received:3\r\nevicted_keys:7\r\nexpired_keys:0\r\n")
    name = b"kvstore:v2:g1:{" + KEYS[0].hex().encode() + b"}"
    return {
        "get-two-values": seed("get", 2, values[0] + values[1]),
        "get-value-nil-value": seed("get", 3, values[0] + b"$-1\r\n" + values[2], chunk=7),
        "get-leading-torn-then-del": seed("get-leading", 2, values[0] + _bulk(bytes(torn)), _int(1)),
        "get-odd-length-and-error": seed("get", 3, values[0] + b"$3\r\nabc\r\n" + b"-ERR wrong\r\n", _int(1)),
        "get-resp3-null-and-blob-error": seed("get", 2, b"_\r\n!9\r\nERR oops!\r\n"),
        "get-ask-followed": seed("get", 1, b"-ASK 3999 127.0.0.1:7002\r\n", b"+OK\r\n" + values[0]),
        "get-moved": seed("get", 2, values[0] + b"-MOVED 3999 127.0.0.1:7001\r\n"),
        "lookup-then-get": seed("lookup-get", 2, values[0] + values[1]),
        "lookup-then-get-nil": seed("lookup-get", 2, values[0] + b"$-1\r\n"),
        "exists": seed("exists", 3, _int(1) + _int(1) + _int(0)),
        "put-exists-then-set": seed("put", 2, _int(0) + _int(1), b"+OK\r\n"),
        "put-set-oom": seed("put", 2, _int(0) + _int(0), b"+OK\r\n-OOM command not allowed\r\n"),
        "stats": seed("stats", 1, info_memory + info_stats + _int(42)),
        "delete": seed("delete", 2, _int(1) + _int(0)),
        "forget-owner": seed("forget-owner", 1, _array(_bulk(b"0"), _array(_bulk(name))),
                             _bulk(_value(KEYS[0])[: codec.FIXED.size]), _int(1)),
        "cluster-get": seed("get", 2, slots, values[0], values[1], cluster=True),
        "cluster-one-node-get": seed("get", 4, one_slot_map, b"".join(values), cluster=True),
        "cluster-get-moved": seed("get", 1, one_slot_map, b"-MOVED 866 127.0.0.1:7001\r\n", cluster=True),
        "cluster-stats": seed("stats", 1, slots, *[info_memory + info_stats + _int(5)] * 3, cluster=True),
        "cluster-put": seed("put", 4, one_slot_map, _int(0) * 4, b"+OK\r\n" * 4, cluster=True),
        "cluster-primary-fails-replica-reads": seed("get", 1, one_slot_map, b"", b"+OK\r\n" + values[0], cluster=True),
        "breaker-opens-then-probe": seed("lookup-get", 1, b"", b"", b"+PONG\r\n", then="get"),
        "put-then-read-back": seed("put", 2, _int(0) * 2, b"+OK\r\n" * 2, values[0] + values[1], then="get"),
        "cluster-slots-error": seed("get", 1, b"-ERR This instance has cluster support disabled\r\n", cluster=True),
    }
