"""The remote tier when Redis fails: paused, killed, down at start, down and back.

Every case holds the tier's contract: nothing raises to the caller, no wrong bytes, each
failure is a counted miss or a counted dropped write, and hits come back with the nodes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis

from kvstore.tiers.remote import RemoteTier, parse_url
from kvstore.tiers.remote.nodes import error_kind
from kvstore.tiers.remote.topology import Topology
from kvstore.tools.bench.redis_local import MIB, RedisCluster, RedisServer, cli, free_port, need_binaries

from factories import require
from remote_helpers import PAYLOAD, TrickleNode, keys, owner_port, payloads, tier
from waiting import wait_until


def round_trip(t: RemoteTier, tag: str, n: int = 12) -> bool:
    """Put fresh blocks and read them back exactly."""
    ks = keys(tag, n)
    data = payloads(ks)
    t.put(ks, list(data))
    out = np.zeros_like(data)
    return all(t.get(ks, list(out))) and np.array_equal(out, data)


def split_by_primary(t: RemoteTier, cluster: RedisCluster, port: int, tag: str) -> tuple[list[bytes], list[bytes]]:
    """16 keys held by the primary on ``port``, and 16 held elsewhere."""
    on: list[bytes] = []
    off: list[bytes] = []
    for k in keys(tag, 400):
        (on if owner_port(cluster, t.names([k])[0]) == port else off).append(k)
    return on[:16], off[:16]


def test_client_pause_takes_the_timeout_path_within_the_deadline(cluster: RedisCluster) -> None:
    """The timeout path itself: replica reads off (with them, the replica answers; below)."""
    timeout = 0.5
    with tier(cluster.url, timeout_s=timeout, breaker_threshold=2, breaker_cooldown_s=0.5, replica_reads=False) as t:
        paused = cluster.primaries()[0]
        on, off = split_by_primary(t, cluster, paused.port, "pause")
        ks = on + off
        data = payloads(ks)
        assert t.put(ks, list(data)) == 32
        cli(paused.port, "CLIENT", "PAUSE", "4000", "ALL")
        out = np.zeros_like(data)
        started = time.monotonic()
        ok = t.get(ks, list(out))
        elapsed = time.monotonic() - started
        assert elapsed < timeout + 1.0, f"get took {elapsed:.2f} s with a {timeout} s timeout"
        assert ok == [False] * 16 + [True] * 16 and np.array_equal(out[16:], data[16:])
        assert t.stats()["errors_timeout"] >= 1
        t.get(ks, list(out))  # the second timeout opens the paused node's circuit
        started = time.monotonic()
        assert t.get(ks, list(out)) == [False] * 16 + [True] * 16
        assert time.monotonic() - started < timeout, "an open circuit must not wait for the node"
        assert t.stats()["errors_unavailable"] >= 1
        # past the cool-down (under test), still paused: a background probe, not this call, waits
        time.sleep(0.7)
        started = time.monotonic()
        assert t.get(ks, list(out)) == [False] * 16 + [True] * 16
        assert time.monotonic() - started < timeout, "a half-open circuit must not make a caller wait"
        wait_until(lambda: all(t.get(ks, list(out))), 10, "hits after the pause", poll_s=0.1)
        assert np.array_equal(out, data)


def test_sigkill_of_a_primary_during_a_storm(cluster: RedisCluster) -> None:
    """Readers and a writer run while a primary dies; its replica takes over."""
    failures: list[BaseException] = []
    wrong: list[int] = []
    hits: list[tuple[float, int, int]] = []  # (time, hits, asked)
    stop = threading.Event()
    with tier(cluster.url, timeout_s=0.3, breaker_cooldown_s=0.3) as t:
        written: list[list[bytes]] = []

        def storm() -> None:
            i = 0
            try:
                while not stop.is_set():
                    ks = keys(f"storm-{i}", 8)
                    t.put(ks, list(payloads(ks)))
                    written.append(ks)
                    recent = [k for chain in written[-4:] for k in chain]
                    out = np.zeros((len(recent), PAYLOAD), dtype=np.uint8)
                    ok = t.get(recent, list(out))
                    want = payloads(recent)
                    wrong.extend(j for j in range(len(recent)) if ok[j] and not np.array_equal(out[j], want[j]))
                    hits.append((time.monotonic(), sum(ok), len(recent)))
                    i += 1
            except BaseException as e:  # the contract: nothing reaches the caller
                failures.append(e)

        worker = threading.Thread(target=storm)
        worker.start()
        wait_until(lambda: len(hits) >= 10, 10, "the storm under way")
        victim = cluster.primaries()[1]
        killed_at = time.monotonic()
        victim.kill()
        cluster.wait_failover(victim)
        recovered = time.monotonic()
        wait_until(lambda: bool(hits) and hits[-1][0] > recovered + 1 and hits[-1][1] == hits[-1][2],
                   15, "full hits after the failover", poll_s=0.1)
        stop.set()
        worker.join(30)
        assert not failures, failures
        assert not wrong, f"{len(wrong)} blocks came back with other bytes"
        during = [h for h in hits if killed_at < h[0] < recovered]
        assert during and any(h[1] < h[2] for h in during), "the kill should have cost some hits"
        s = t.stats()
        assert s["errors"] > 0 and s["errors_connection"] + s["errors_timeout"] + s["errors_unavailable"] > 0
        assert round_trip(t, "after-failover")


def test_the_whole_cluster_down_then_back(cluster: RedisCluster) -> None:
    with tier(cluster.url, timeout_s=0.3, breaker_cooldown_s=0.3) as t:
        assert round_trip(t, "before-down")
        for node in cluster.nodes:
            node.kill()
        ks = keys("down", 8)
        out = np.zeros((8, PAYLOAD), dtype=np.uint8)
        started = time.monotonic()
        assert t.get(ks, list(out)) == [False] * 8
        assert t.put(ks, list(payloads(ks))) == 0
        assert t.put_async(ks, list(payloads(ks))) <= 8 and t.flush(10)
        assert time.monotonic() - started < 3
        s = t.stats()
        assert s["nodes_up"] == 0 and s["errors"] > 0 and s["dropped"] >= 8
        for node in cluster.nodes:
            node.start()
        cluster.wait_ok()
        wait_until(lambda: round_trip(t, f"back-{time.monotonic()}"), 20, "the tier working again",
                   poll_s=0.1)


def test_one_server_down_at_start_then_up_then_down_and_back(tmp_path: Path) -> None:
    port = free_port(bus=False)
    with tier(f"redis://127.0.0.1:{port}", timeout_s=0.3, breaker_cooldown_s=0.2) as t:
        ks = keys("late", 8)
        out = np.zeros((8, PAYLOAD), dtype=np.uint8)
        assert t.get(ks, list(out)) == [False] * 8 and t.exists(ks) == 0
        t.put_async(ks, list(payloads(ks)))
        assert t.flush(10)
        s = t.stats()
        assert s["errors_connection"] >= 1 and s["dropped"] == 8 and s["nodes_up"] == 0
        server = RedisServer.start(tmp_path, port=port)
        try:
            wait_until(lambda: round_trip(t, f"up-{time.monotonic()}"), 10, "the tier working with Redis up",
                       poll_s=0.1)
            server.close()
            assert t.get(ks, list(out)) == [False] * 8  # down again: misses, no exception
            server = RedisServer.start(tmp_path, port=port)
            wait_until(lambda: round_trip(t, f"again-{time.monotonic()}"), 10, "the tier working again",
                       poll_s=0.1)
        finally:
            server.close()


@pytest.mark.parametrize("bad", ["redis://127.0.0.1:1", "redis+cluster://127.0.0.1:1,127.0.0.1:2"])
def test_nothing_listening_costs_little(bad: str) -> None:
    started = time.monotonic()
    with tier(bad, timeout_s=0.2) as t:
        ks = keys("nobody", 4)
        assert t.get(ks, list(np.zeros((4, PAYLOAD), dtype=np.uint8))) == [False] * 4
        assert t.put(ks, list(payloads(ks))) == 0
        assert t.stats()["errors"] >= 1
    assert time.monotonic() - started < 3


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_a_node_that_trickles_its_reply_is_one_timeout_per_call(where: str) -> None:
    """Each byte comes within the socket timeout, the reply never within the call's deadline:
    the call returns after timeout_s anyway, on the caller's thread and on the pool's (a
    cluster's two nodes), and each call charges each node's breaker once."""
    timeout = 0.5
    with TrickleNode() as a, TrickleNode() as b:
        a.slots = b.slots = [(0, 8191, a.port), (8192, 16383, b.port)]
        url = a.url if where == "server" else f"redis+cluster://127.0.0.1:{a.port}"
        with tier(url, timeout_s=timeout, breaker_threshold=2) as t:
            ks = keys(f"trickle-{where}", 8)
            out = np.zeros((8, PAYLOAD), dtype=np.uint8)

            def timed(call: Callable[[], object], want: object) -> float:
                started = time.monotonic()
                assert call() == want
                return time.monotonic() - started

            # two timeouts open the circuit: one per call, not one per socket read or worker
            for elapsed in (timed(lambda: t.get(ks, list(out)), [False] * 8),
                            timed(lambda: t.put(ks, list(payloads(ks))), 0)):
                assert 0.8 * timeout < elapsed < timeout + 1.0, f"{elapsed:.2f} s with a {timeout} s deadline"
            # A cluster's second node runs on the pool: on a loaded machine its worker may
            # start after the deadline, and a node never asked is not charged. So its circuit
            # may need one more call.
            for _ in range(3):
                if timed(lambda: t.exists(ks), 0) < timeout / 2:
                    break
            else:
                raise AssertionError(f"the circuit never opened: {t.stats()}")
            s = t.stats()
            # the lone server: exactly its two calls; a cluster's two nodes: two each at least
            # (a call that times out on both counts both, however the workers were scheduled)
            assert (s["errors_timeout"] == 2 if where == "server" else s["errors_timeout"] >= 4), s
            assert s["errors_unavailable"] >= 1
            assert s["misses"] == 8 and s["dropped"] == 8 and not out.any()


def test_a_pool_busy_with_a_stalled_node_charges_no_other_node(cluster: RedisCluster) -> None:
    """One worker, stuck on a node that never answers: the healthy node queued behind it is
    not asked once the deadline passed (cancelled, not charged), and the stalled node's
    breaker is charged once per call, not once by the worker and again by the caller."""
    timeout = 0.5
    with TrickleNode(byte_delay=30) as dead:
        top = Topology(parse_url(cluster.url), timeout, breaker_threshold=2, breaker_cooldown_s=30, max_workers=1)
        try:
            stalled = ("127.0.0.1", dead.port)
            inline, queued = (("127.0.0.1", n.port) for n in cluster.primaries()[:2])

            def echoes() -> int:
                stats = cli(queued[1], "INFO", "commandstats")
                return int(stats.split("cmdstat_echo:calls=")[1].split(",")[0]) if "cmdstat_echo" in stats else 0

            # sorted by size: the caller runs the biggest; the pool's one worker takes the
            # stalled node first, so the queued node waits behind it
            batches = {stalled: [("GET", "k")], queued: [("ECHO", "q")] * 2, inline: [("ECHO", "i")] * 3}
            before = echoes()
            for call in (1, 2):
                started = time.monotonic()
                replies = top.run(batches)
                assert time.monotonic() - started < timeout + 1.0
                assert replies[inline].results == [b"i"] * 3
                top._pool.submit(lambda: None).result(10)  # the pool's one worker is free: past its deadline
                assert top.breaker(stalled).state == ("closed" if call == 1 else "open"), f"after call {call}"
                assert top.breaker(queued).state == "closed"
                assert echoes() == before, "a cancelled pipeline still reached its node"
                assert error_kind(replies[stalled].error) == "timeout"  # type: ignore[arg-type]
                assert replies[queued].results is None and error_kind(replies[queued].error) == "unavailable"  # type: ignore[arg-type]
            replies = top.run(batches)  # the stalled node's circuit is open: the worker is free
            assert replies[queued].results == [b"q"] * 2 and error_kind(replies[stalled].error) == "unavailable"  # type: ignore[arg-type]
        finally:
            top.close()


def test_reads_of_a_killed_primary_go_to_its_replica_until_the_failover(tmp_path: Path) -> None:
    """A primary killed: its slots' reads go to its replica (READONLY) at once, long before the
    cluster promotes it (node timeout 2 s), with the right bytes; writes to it are dropped and
    counted meanwhile; after the failover the promoted replica serves reads and writes."""
    require(need_binaries() is None, "no redis-server: the failover test needs a real Redis Cluster")
    cluster = RedisCluster.start(tmp_path / "cluster", maxmemory=24 * MIB, node_timeout_ms=2000)
    try:
        with tier(cluster.url, timeout_s=0.3, breaker_cooldown_s=0.3) as t:
            victim = cluster.primaries()[0]
            on, off = split_by_primary(t, cluster, victim.port, "failover")
            ks = on[:8] + off[:8]
            data = payloads(ks)
            t.put(ks, list(data))
            assert redis.Redis(port=victim.port).execute_command("WAIT", 1, 5000) == 1, "the replica took the writes"
            out = np.zeros_like(data)
            assert all(t.get(ks, list(out))) and np.array_equal(out, data)
            t.forget_hints()  # every read below asks the nodes

            victim.kill()
            killed_at = time.monotonic()
            reads: list[tuple[float, float, int]] = []  # (start, end, hits) after the kill
            wrong = 0
            while time.monotonic() - killed_at < 1.5:
                started = time.monotonic()
                out = np.zeros_like(data)
                ok = t.get(ks, list(out))
                reads.append((started - killed_at, time.monotonic() - killed_at, sum(ok)))
                wrong += sum(1 for j in range(len(ks)) if ok[j] and not np.array_equal(out[j], data[j]))
                t.forget_hints()
            assert cluster.replica_of(victim) is not None, "the replica must not be promoted yet (node timeout 2 s)"
            assert wrong == 0
            late = [r for r in reads if r[0] >= 1.0]
            assert late and all(hits == len(ks) for _s, _e, hits in late), \
                f"reads from 1 s after the kill on must all hit; got {[r for r in reads if r[2] < len(ks)][:5]}"
            s = t.stats()
            assert s["replica_reads"] > 0 and s["errors"] > 0
            dropped = s["dropped"]
            fresh = on[8:12]  # more keys of the dead primary's slots, never written
            t.put(fresh, list(payloads(fresh)))
            assert t.stats()["dropped"] > dropped, "writes to a down primary are dropped and counted"

            cluster.wait_failover(victim)
            wait_until(lambda: round_trip(t, f"after-failover-{time.monotonic()}"), 15,
                       "reads and writes after the failover", poll_s=0.2)
            out = np.zeros_like(data)
            assert all(t.get(ks, list(out))) and np.array_equal(out, data)
    finally:
        cluster.close()
