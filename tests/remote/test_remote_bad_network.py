"""The remote tier over a bad network (issue 47): Redis reached through a proxy that delays,
swallows, truncates, resets, corrupts and mixes up replies (faulty_proxy.py).

The cluster is real: its three primaries announce their proxy's port (``cluster-announce-port``),
so ``CLUSTER SLOTS`` and every ``MOVED`` name the proxies, and the tier, seeded with the
proxies' ports, never reaches a node but through one. The replicas are stopped first: a
replica follows its primary's announced address, and its replication stream would share
the faults.

Each case holds the tier's contract on the caller's side: no exception, every block delivered
is exactly the bytes put under its key (content derives from the key), every block refused is
a counted miss and every block not written a counted dropped (or skipped) write, each call
returns within the remote deadline plus a margin, and hits come back once the network heals.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pytest
import redis

from kvstore.engine.llm import LLMEngine
from kvstore.engine.sampling import SamplingParams
from kvstore.tiers.remote import RemoteTier, codec
from kvstore.tiers.remote.topology import TRANSFER_FLOOR
from kvstore.tools.bench.redis_local import RedisCluster, cli

from faulty_proxy import Faults, FaultyProxy
from remote_helpers import LAYOUT_ID, PAYLOAD, keys, payloads
from waiting import wait_until

T = TypeVar("T")

TIMEOUT = 0.4  # the tier's timeout_s: every call's deadline (plus its values' time at TRANSFER_FLOOR)
MARGIN = 0.25  # what a call may take past its deadline: thread hand-offs on a shared 2-core machine
BLOCKS = 6  # blocks per put and per read
VALUE_BYTES = codec.header_bytes(32) + PAYLOAD
# A call moves at most BLOCKS values through one node: its deadline, and the bound a caller sees.
DEADLINE = TIMEOUT + BLOCKS * VALUE_BYTES / TRANSFER_FLOOR
BOUND = DEADLINE + MARGIN


@pytest.fixture(scope="module")
def proxy(cluster: RedisCluster) -> Iterator[FaultyProxy]:
    """The module's cluster, its replicas stopped, its primaries announcing one proxy port each."""
    primaries = cluster.primaries()
    for node in cluster.nodes:
        if node not in primaries:
            node.stop()
    found = FaultyProxy([("127.0.0.1", n.port) for n in primaries], seed=47)
    try:
        for node, port in zip(primaries, found.ports, strict=True):
            assert cli(node.port, "CONFIG", "SET", "cluster-announce-port", str(port)).strip() == "OK"

        def announced() -> bool:  # every node names the proxies, and only them
            return all(_ports_named(n.port) == set(found.ports) for n in primaries)

        wait_until(announced, 30, "every primary announcing its proxy's port, no replica named")
        yield found
    finally:
        found.close()


@pytest.fixture(autouse=True)
def healthy_afterwards(proxy: FaultyProxy) -> Iterator[None]:
    yield
    proxy.set(Faults())


def _ports_named(port: int) -> set[int]:
    """Every port CLUSTER SLOTS, asked of the node itself, names (primaries and replicas)."""
    with redis.Redis(port=port) as r:
        return {int(node[1]) for entry in r.execute_command("CLUSTER", "SLOTS") for node in entry[2:]}


def url_of(proxy: FaultyProxy) -> str:
    return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in proxy.ports)


def remote(proxy: FaultyProxy, **kwargs: object) -> RemoteTier:
    """A tier whose seeds are the proxies. By default its breakers never open, so that every
    call crosses the faulty network (a test of the breaker says so)."""
    kwargs.setdefault("breaker_threshold", 1_000_000)
    return RemoteTier(url_of(proxy), PAYLOAD, LAYOUT_ID, timeout_s=TIMEOUT, **kwargs)  # type: ignore[arg-type]


@dataclass
class Ledger:
    """What the caller saw: blocks delivered, refused and wrong, put blocks not written, and
    the slowest call."""

    delivered: int = 0
    refused: int = 0
    wrong: int = 0
    unwritten: int = 0
    slowest_s: float = 0.0
    slowest: str = ""
    calls: int = 0

    def timed(self, what: str, call: Callable[[], T]) -> T:
        started = time.monotonic()
        result = call()
        elapsed = time.monotonic() - started
        self.calls += 1
        if elapsed > self.slowest_s:
            self.slowest_s, self.slowest = elapsed, what
        return result

    def read(self, t: RemoteTier, ks: list[bytes], data: np.ndarray) -> None:
        out = np.full_like(data, 0xA5)
        ok = self.timed("get", lambda: t.get(ks, list(out)))
        for i, good in enumerate(ok):
            if good:
                self.delivered += 1
                self.wrong += int(not np.array_equal(out[i], data[i]))
            else:
                self.refused += 1


def exercise(t: RemoteTier, tag: str, rounds: int) -> Ledger:
    """Per round: put fresh blocks, look them up and read them (the lookup's kept values), and
    read the previous round's blocks again (GETs of values written through the faults)."""
    ledger = Ledger()
    previous: tuple[list[bytes], np.ndarray] | None = None
    for r in range(rounds):
        ks = keys(f"{tag}-{r}", BLOCKS)
        data = payloads(ks)
        ledger.unwritten += BLOCKS - ledger.timed("put", functools.partial(t.put, ks, list(data)))
        ledger.timed("lookup", functools.partial(t.lookup, ks))
        ledger.read(t, ks, data)
        if previous is not None:
            ledger.read(t, *previous)
        previous = ks, data
    return ledger


def round_trip(t: RemoteTier, tag: str) -> bool:
    ks = keys(tag, BLOCKS)
    data = payloads(ks)
    t.put(ks, list(data))
    out = np.zeros_like(data)
    return all(t.get(ks, list(out))) and np.array_equal(out, data)


def check_contract(t: RemoteTier, ledger: Ledger, base: dict[str, int]) -> dict[str, int]:
    """No wrong bytes, every failure counted, every call within the bound; the counters'
    growth since ``base``."""
    now = t.stats()
    s = {k: v - base.get(k, 0) for k, v in now.items()}
    assert ledger.wrong == 0, f"{ledger.wrong} blocks came back with other bytes"
    assert (s["hits"], s["misses"]) == (ledger.delivered, ledger.refused), s
    assert s["dropped"] + s["skipped"] == ledger.unwritten, s
    assert ledger.slowest_s <= BOUND, (f"a {ledger.slowest} took {ledger.slowest_s:.3f} s: past the {DEADLINE:.3f} s "
                                       f"deadline + {MARGIN} s")
    return s


def heals(t: RemoteTier, proxy: FaultyProxy, timeout: float = 15) -> None:
    """With the faults off, hits come back (once the breakers, if open, probed the nodes)."""
    proxy.set(Faults())
    wait_until(lambda: round_trip(t, f"healed-{time.monotonic()}"), timeout, "hits after the network healed",
               poll_s=0.1)


# ------------------------------------------------------------------------------------------ the proxy


def _raw_get(port: int, name: bytes, timeout: float, want: int) -> tuple[bytes, BaseException | None]:
    """Send one GET on a fresh socket; the reply's bytes (up to ``want``) that came before EOF,
    an error or ``timeout``, and that error."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name))
        try:
            while len(got) < want and (chunk := s.recv(1 << 16)):
                got += chunk
        except OSError as e:
            return got, e
    return got, None


def test_the_proxy_breaks_the_network_as_told(cluster: RedisCluster, proxy: FaultyProxy) -> None:
    """Each fault at probability 1 on a raw socket, then a clean close: no thread, no listener,
    no socket left open, a connection still open cut."""
    primary = cluster.primaries()[0]
    threads = set(threading.enumerate())
    num_fds = len(os.listdir("/proc/self/fd"))
    with FaultyProxy([("127.0.0.1", primary.port)], seed=1) as own:
        value = "x" * 100_000
        name = next(n for n in (b"bad-net-%d" % i for i in range(100))  # one this primary owns
                    if cli(primary.port, "SET", n.decode(), value).strip() == "OK")
        full = b"$100000\r\n" + b"x" * 100_000 + b"\r\n"
        got, error = _raw_get(own.ports[0], name, 5, len(full))
        assert got == full and error is None
        own.set(Faults(truncate=1))
        got, error = _raw_get(own.ports[0], name, 5, len(full))
        assert len(got) < len(full) and full.startswith(got) and error is None  # cut, then FIN
        own.set(Faults(reset=1))
        got, error = _raw_get(own.ports[0], name, 5, len(full))
        assert len(got) < len(full) and isinstance(error, ConnectionResetError)
        own.set(Faults(drop=1))
        got, error = _raw_get(own.ports[0], name, 0.3, len(full))
        assert got == b"" and isinstance(error, TimeoutError)
        own.set(Faults(latency_s=0.2))
        started = time.monotonic()
        got, error = _raw_get(own.ports[0], name, 5, len(full))
        assert got == full and time.monotonic() - started >= 0.2
        own.set(Faults(corrupt=1))
        got, error = _raw_get(own.ports[0], name, 1, len(full))  # Redis may keep a bad request's connection
        assert got != full  # a byte of the request and one of the reply: bits flipped
        counts = own.counts()
        assert all(counts[k] > 0 for k in ("truncate", "reset", "drop", "latency", "corrupt")), counts
        port = own.ports[0]
        own.set(Faults(drop=1))
        held = socket.create_connection(("127.0.0.1", port), timeout=5)  # still open at close()
        held.sendall(b"*1\r\n$4\r\nPING\r\n")
        wait_until(lambda: own.counts()["drop"] == counts["drop"] + 1, 10, "the held connection's PING swallowed")
    with held, contextlib.suppress(ConnectionResetError):  # cut either way: FIN or RST
        assert held.recv(1) == b""
    assert set(threading.enumerate()) == threads, "the proxy's thread outlived close()"
    assert len(os.listdir("/proc/self/fd")) == num_fds, "the proxy left a socket open"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# ------------------------------------------------------------------------------------------ one fault


# fault -> (what the proxy does, the tier's counters that must have moved)
FAULTS: dict[str, tuple[Faults, tuple[str, ...]]] = {
    "latency": (Faults(latency_s=0.3, slow=0.35), ("errors_timeout",)),
    "drop": (Faults(drop=0.15), ("errors_timeout", "dropped", "misses")),
    "truncate": (Faults(truncate=0.2), ("errors_connection", "misses")),
    "reset": (Faults(reset=0.2), ("errors_connection", "misses")),
    "corrupt": (Faults(corrupt=0.2), ("errors_corrupt", "misses")),
    "mix": (Faults(mix=0.5), ("corrupt_key", "misses")),
}


@pytest.mark.parametrize("kind", list(FAULTS))
def test_a_fault_costs_hits_never_bytes(proxy: FaultyProxy, kind: str) -> None:
    faults, moved = FAULTS[kind]
    with remote(proxy) as t:
        assert round_trip(t, f"{kind}-before")  # the slot map learned, connections open
        base = t.stats()
        proxy.set(faults)
        applied = proxy.counts()[kind]
        ledger = exercise(t, kind, rounds=10)
        assert proxy.counts()[kind] > applied, f"the proxy applied no {kind}"
        s = check_contract(t, ledger, base)
        assert ledger.delivered > 0, "some blocks should have crossed the faulty network"
        for counter in moved:
            assert s.get(counter, 0) > 0, f"{counter} did not move under {kind}: {s}"
        if kind not in ("corrupt", "mix"):  # a cut or late reply is never taken for a value to check
            assert s["errors_corrupt"] == 0, s
        heals(t, proxy)


def test_every_fault_at_once_with_the_breakers_on(proxy: FaultyProxy) -> None:
    """All faults together, the breakers at their defaults: they open and probe; the contract
    holds throughout, and hits come back once the network heals."""
    with remote(proxy, breaker_threshold=3, breaker_cooldown_s=0.2) as t:
        assert round_trip(t, "all-before")
        base = t.stats()
        proxy.set(Faults(latency_s=0.2, slow=0.1, drop=0.05, truncate=0.05, reset=0.05, corrupt=0.05, mix=0.2))
        ledger = exercise(t, "all", rounds=12)
        s = check_contract(t, ledger, base)
        assert s["errors"] > 0
        heals(t, proxy)


# ------------------------------------------------------------------------------------------ an engine

TINY = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
            vocab_size=256, max_position_embeddings=512)


def engine(**kwargs: object) -> LLMEngine:
    """A random tiny model (kvstore/engine/checkpoint/random_model.py), the same weights each time."""
    opts: dict[str, object] = dict(random_model=TINY, kv_cache_bytes=1 << 22, block_size=16, fetch_policy="always")
    opts.update(kwargs)
    return LLMEngine(None, **opts)  # type: ignore[arg-type]


def test_an_engine_on_a_bad_network_generates_what_a_storeless_one_does(proxy: FaultyProxy) -> None:
    """One engine writes the prompts' blocks to the cluster over a healthy network; a second,
    with nothing local, serves the same prompts while every fault is on. Its tokens are the
    store-less engine's, and the remote's share of each time to first token (the lookup, and
    the fetch after it) stays within the deadline of one call each."""
    prompts = [[p, *((7 * p + i) % 256 for i in range(190))] for p in range(8)]  # 11 full blocks + 15 tokens
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    remote_opts = dict(host_bytes=1 << 24, remote_url=url_of(proxy), remote_timeout_s=TIMEOUT)
    alone = engine(host_bytes=0)
    try:
        recomputed = alone.generate(prompts, params)
    finally:
        alone.close()
    writer = engine(**remote_opts)
    try:
        assert [o.token_ids for o in writer.generate(prompts, params)] == [o.token_ids for o in recomputed]
        assert writer.evict_device_cache() > 0
        assert writer.store.flush(timeout=10)
    finally:
        writer.close()
    reader = engine(**remote_opts)
    try:
        proxy.set(Faults(latency_s=0.2, slow=0.1, drop=0.05, truncate=0.05, reset=0.05, corrupt=0.05, mix=0.2))
        remote_s: list[float] = []
        fetched = 0
        for prompt, want in zip(prompts, recomputed, strict=True):
            out = reader.generate([prompt], params)[0]
            assert out.token_ids == want.token_ids
            stages = out.metrics.stages
            assert stages["lookup"] <= BOUND and stages["fetch"] <= BOUND, stages
            remote_s.append(stages["lookup"] + stages["fetch"])
            fetched += out.metrics.cached_tokens.get("remote", 0)
        s = reader.stats()["remote"]
        assert s["errors"] > 0 and fetched > 0, s  # faults met, and some blocks crossed them
    finally:
        reader.close()


# ------------------------------------------------------------------------------------------ regressions


@pytest.mark.parametrize("read", ["get", "lookup"])
def test_a_read_that_meets_a_bad_value_ends_by_its_deadline(cluster: RedisCluster, proxy: FaultyProxy,
                                                            read: str) -> None:
    """A value that fails its checks is deleted by the read that found it. That DEL used to be
    a second call with a deadline of its own: over a slow network a read took two deadlines.
    It now shares the read's deadline (and times out, counted, when the GET used it up)."""
    timeout, size = 1.0, 4096  # a value of one chunk: the proxy delays it once
    with RemoteTier(url_of(proxy), size, LAYOUT_ID, timeout_s=timeout, breaker_threshold=1_000_000) as t:
        ks = keys(f"bad-value-{read}", 1)
        data = payloads(ks, size)
        assert t.put(ks, list(data)) == 1
        name = t.names(ks)[0].decode()
        port = next(n.port for n in cluster.primaries() if cli(n.port, "EXISTS", name).strip() == "1")
        assert cli(port, "SETRANGE", name, "200", "X").strip().isdigit()  # a payload byte: the checksum's
        t.forget_hints()  # the put's "held" hint would answer the lookup without a request
        proxy.set(Faults(latency_s=0.6 * timeout))  # every reply late: the GET's in time, the DEL's not
        out = np.zeros_like(data)
        started = time.monotonic()
        assert (t.get(ks, list(out)) if read == "get" else t.lookup(ks)) == ([False] if read == "get" else 0)
        elapsed = time.monotonic() - started
        assert elapsed <= timeout + MARGIN, f"the {read} took {elapsed:.2f} s with a {timeout} s deadline"
        s = t.stats()
        assert s["corrupt_checksum"] == 1 and s["errors_timeout"] == 1, s


def test_a_new_tier_on_a_dead_network_answers_within_its_deadline(proxy: FaultyProxy) -> None:
    """A fresh tier's first read asks for the slot map. Every seed's connection swallows it:
    discovery shares the read's deadline (it used to wait one per seed), and the blocks are
    misses; the slot map is learned once the network heals."""
    proxy.set(Faults(drop=1))
    with remote(proxy) as t:
        ks = keys("dead-network", BLOCKS)
        out = np.zeros((BLOCKS, PAYLOAD), dtype=np.uint8)
        started = time.monotonic()
        assert t.get(ks, list(out)) == [False] * BLOCKS
        elapsed = time.monotonic() - started
        assert elapsed <= BOUND, f"the first read took {elapsed:.2f} s with a {DEADLINE:.3f} s deadline"
        assert t.stats()["misses"] == BLOCKS and proxy.counts()["drop"] >= 1
        heals(t, proxy)
