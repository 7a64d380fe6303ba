"""The remote tier against a real, healthy Redis Cluster and a real single redis-server."""

from __future__ import annotations

import threading
import time
import tracemalloc

import numpy as np
import pytest
import redis
from redis.crc import key_slot

from kvstore.tiers.remote import RemoteTier, group_tags
from kvstore.tools.bench.redis_local import RedisCluster, RedisServer, cli

from remote_helpers import LAYOUT_ID, PAYLOAD, keys, owner_port, payloads, tier
from waiting import wait_until


def raw(cluster: RedisCluster, name: bytes) -> redis.Redis:
    return redis.Redis(port=owner_port(cluster, name))


@pytest.mark.parametrize("where", ["cluster", "server"])
def test_round_trip_exact_bytes(where: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(where).url
    with tier(url) as t:
        ks = keys(f"round-{where}", 40)
        data = payloads(ks)
        assert t.exists(ks) == 0
        assert t.put(ks, list(data)) == 40
        assert t.exists(ks) == 40 and t.contains(ks[:2] + keys("never", 1)) == [True, True, False]
        out = np.zeros_like(data)
        assert t.get(ks, list(out)) == [True] * 40
        assert np.array_equal(out, data)
        assert t.put(ks, list(data)) == 0  # held already: nothing sent
        s = t.stats()
        assert (s["hits"], s["misses"], s["errors"], s["skipped"]) == (40, 0, 0, 40)
        assert s["bytes_written"] == s["bytes_read"] == 40 * PAYLOAD
        assert s["num_blocks"] >= 40 and s["used_bytes"] > 40 * PAYLOAD and s["capacity_bytes"] > 0
        assert s["nodes_up"] == (3 if where == "cluster" else 1)


def test_a_batch_runs_one_pipeline_per_primary_in_parallel(cluster: RedisCluster) -> None:
    def exists_calls() -> dict[int, int]:
        return {n.port: int(n.info("commandstats").get("cmdstat_exists", "calls=0").split(",")[0][6:])
                for n in cluster.primaries()}

    with tier(cluster.url) as t:
        ks = keys("spread", 64)
        owners = [owner_port(cluster, n) for n in t.names(ks)]
        assert len(set(owners)) == 3  # 64 blocks with G=1 spread over all three primaries
        t.put(ks, list(payloads(ks)))
        before = exists_calls()
        assert t.exists(ks) == 64
        after = exists_calls()
        # each primary ran exactly the EXISTS of its own keys, nothing was redirected
        assert {p: after[p] - before[p] for p in before} == {p: owners.count(p) for p in before}


def test_leading_run_stops_at_the_first_gap(cluster: RedisCluster) -> None:
    with tier(cluster.url) as t:
        ks = keys("gap", 10)
        t.put(ks[:4] + ks[5:], list(payloads(ks[:4] + ks[5:])))
        assert t.exists(ks) == 4
        out = np.zeros((10, PAYLOAD), dtype=np.uint8)
        assert t.get(ks, list(out)) == [True] * 4 + [False] + [True] * 5


def test_run_length_groups_share_a_slot_and_round_trip(cluster: RedisCluster) -> None:
    with tier(cluster.url, run_length=4) as t:
        ks = keys("g4", 12)
        tags = group_tags(ks, 4)
        names = t.names(ks, tags)
        assert len({owner_port(cluster, n) for n in names[:4]}) == 1
        t.put(ks, list(payloads(ks)), tags)
        out = np.zeros((12, PAYLOAD), dtype=np.uint8)
        assert t.get(ks, list(out), tags) == [True] * 12 and np.array_equal(out, payloads(ks))
        with pytest.raises(ValueError, match="group tag"):
            t.names(ks)
    with tier(cluster.url) as g1:  # another G names other keys: they never meet
        assert g1.exists(ks) == 0


@pytest.mark.parametrize("damage", ["setrange", "truncate", "other_layout", "other_key", "garbage"])
def test_bad_values_are_counted_misses_and_deleted(cluster: RedisCluster, damage: str) -> None:
    with tier(cluster.url) as t:
        ks = keys(f"bad-{damage}", 3)
        data = payloads(ks)
        t.put(ks, list(data))
        name = t.names(ks[1:2])[0]
        r = raw(cluster, name)
        if damage == "setrange":
            r.setrange(name, 40_000, b"\xff" if r.getrange(name, 40_000, 40_000) != b"\xff" else b"\x00")
        elif damage == "truncate":
            r.set(name, r.getrange(name, 0, 1000))
        elif damage == "other_layout":
            with RemoteTier(cluster.url, PAYLOAD, LAYOUT_ID + "-other") as other:
                r.delete(name)
                other.put(ks[1:2], list(data[1:2]))
        elif damage == "other_key":
            r.set(name, raw(cluster, t.names(ks[:1])[0]).get(t.names(ks[:1])[0]))
        else:
            r.set(name, b"not a block at all")
        out = np.zeros_like(data)
        assert t.get(ks, list(out)) == [True, False, True]
        assert not out[1].any(), "a rejected value must not reach the caller's memory"
        s = t.stats()
        assert s["errors"] == s["errors_corrupt"] == 1 and s["misses"] == 1
        assert r.exists(name) == 0, "the bad value stays in the cluster"
        assert t.get(ks[1:2], [out[1]]) == [False]  # now simply absent: a miss, no new error
        assert t.stats()["errors"] == 1


def test_write_behind_flushes_and_drops_when_full(cluster: RedisCluster) -> None:
    with tier(cluster.url, queue_blocks=8, batch_blocks=4) as t:
        ks = keys("behind", 6)
        data = payloads(ks)
        started = time.perf_counter()
        assert t.put_async(ks, list(data)) == 6
        data[:] = 0  # the caller's memory may be reused at once: the tier holds copies
        assert time.perf_counter() - started < 0.5
        assert t.flush(timeout=10)
        out = np.zeros_like(data)
        assert t.get(ks, list(out)) == [True] * 6 and np.array_equal(out, payloads(ks))
        many = keys("flood", 40)
        queued = t.put_async(many, list(payloads(many)))
        assert 8 <= queued < 40  # at most the bound, plus what the writer took meanwhile
        assert t.flush(timeout=10)
        s = t.stats()
        assert s["dropped"] == 40 - queued and s["pending"] == 0
        assert t.exists(many) >= 8


def test_an_offer_past_the_queue_copies_only_what_fits(server: RedisServer) -> None:
    """Room is claimed before anything is framed: 200 blocks offered to a queue of 8 copy 8
    (a write-back at close offers every host block at once)."""
    with tier(server.url, queue_blocks=8, batch_blocks=4) as t:
        ks = keys("room", 200)
        block = payloads(ks[:1])[0]
        tracemalloc.start()
        try:
            queued = t.put_async(ks, [block] * 200)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert queued == 8 and t.stats()["dropped"] == 192
        assert peak < 16 * PAYLOAD, f"offering 200 blocks to a queue of 8 held {peak / PAYLOAD:.0f} blocks"
        assert t.flush(10) and t.exists(ks) == 8  # the leading blocks are the ones kept


def test_the_queue_bound_counts_the_batch_being_sent(server: RedisServer) -> None:
    """queue_blocks bounds every framed value held: queued or in the writer's hands."""
    with tier(server.url, queue_blocks=8, batch_blocks=4, timeout_s=5.0) as t:
        cli(server.node.port, "CLIENT", "PAUSE", "1500", "ALL")  # the writer's batch waits in flight
        first = keys("bound-a", 8)
        assert t.put_async(first, list(payloads(first))) == 8
        wait_until(lambda: len(t._writer._queue) == 4, 10, "the writer taking its batch of 4 from the queue")
        more = keys("bound-b", 8)
        assert t.put_async(more, list(payloads(more))) == 0
        assert t.num_pending == 8
        assert t.flush(10) and t.exists(first) == 8
        assert t.stats()["dropped"] == 8


def test_maxmemory_eviction_is_misses_never_errors(cluster: RedisCluster) -> None:
    """Redis evicts on its own; used_memory stays at the limit (plus at most the command being
    read: Redis checks the limit before each command); nothing raises; evicted blocks miss."""
    limit = cluster.maxmemory
    peaks: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peaks.append(max(int(n.info("memory")["used_memory"]) for n in cluster.primaries()))
            stop.wait(0.05)  # a sample every 50 ms until the puts are done

    sampler = threading.Thread(target=sample)
    with tier(cluster.url, timeout_s=5.0) as t:  # this test is about eviction, not timeouts
        sampler.start()
        ks = keys("evict", 3 * 3 * limit // PAYLOAD)  # three times the cluster's memory
        try:
            for start in range(0, len(ks), 64):
                t.put(ks[start : start + 64], list(payloads(ks[start : start + 64])))
        finally:
            stop.set()
            sampler.join()
        s = t.stats()
        assert s["errors"] == 0 and s["dropped"] == 0, s
        assert s["evictions"] > 0 and s["used_bytes"] <= s["capacity_bytes"] + 3 * 4 * PAYLOAD
        assert max(peaks) <= limit + 4 * PAYLOAD, f"used_memory peaked at {max(peaks)} of {limit}"
        out = np.zeros((64, PAYLOAD), dtype=np.uint8)
        assert t.exists(ks[:64]) < 64  # the oldest are gone
        ok = t.get(ks[:64], list(out))
        assert not all(ok) and t.stats()["errors"] == 0
        want = payloads(ks[:64])
        assert all(np.array_equal(out[i], want[i]) for i in range(64) if ok[i])
    for node in cluster.primaries():  # leave room for the rest of the module
        cli(node.port, "FLUSHALL")


def test_passwords_stay_secret(tmp_path_factory: pytest.TempPathFactory) -> None:
    secret = "pw-never-shown-4711"
    server = RedisServer.start(tmp_path_factory.mktemp("auth"), password=secret)
    try:
        url = f"redis://default:{secret}@127.0.0.1:{server.node.port}"
        with tier(url) as good:
            ks = keys("auth", 2)
            assert good.put(ks, list(payloads(ks))) == 2
            assert secret not in repr(good) and secret not in str(good.stats())
            assert secret not in str([n.as_dict() for n in good.nodes()])
        wrong = f"redis://default:wrong-{secret}@127.0.0.1:{server.node.port}"
        with tier(wrong) as bad:
            out = np.zeros((2, PAYLOAD), dtype=np.uint8)
            assert bad.get(ks, list(out)) == [False, False]
            assert bad.put(ks, list(payloads(ks))) == 0
            s = bad.stats()
            assert s["errors_auth"] >= 1 and s["misses"] == 2 and s["dropped"] == 2
            assert secret not in repr(bad) and secret not in str(s)
            assert all(secret not in n.error for n in bad.nodes())
    finally:
        server.close()


def test_an_ask_redirect_is_followed_and_the_slot_map_stays(cluster: RedisCluster) -> None:
    """Mid-migration the source answers ASK for the keys it gave away: each is read from the
    importing node (ASKING), the rest from the source, and no MOVED-style remap flips the slot
    (last in the module: it moves a slot for good)."""
    with tier(cluster.url, run_length=4) as t:
        ks = keys("ask", 4)
        tags = group_tags(ks, 4)
        names = t.names(ks, tags)  # one group: one slot
        data = payloads(ks)
        assert t.put(ks, list(data), tags) == 4
        slot, src = key_slot(names[0]), owner_port(cluster, names[0])
        dst = next(n.port for n in cluster.primaries() if n.port != src)
        src_id, dst_id = (cli(p, "CLUSTER", "MYID").strip() for p in (src, dst))
        cli(dst, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", src_id)
        cli(src, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", dst_id)
        cli(src, "MIGRATE", "127.0.0.1", str(dst), "", "0", "5000", "KEYS", names[0].decode(), names[1].decode())
        for _ in range(3):
            out = np.zeros_like(data)
            assert t.get(ks, list(out), tags) == [True] * 4 and np.array_equal(out, data)
            assert t.exists(ks, tags) == 4
        assert t.put(ks, list(data), tags) == 0  # held on one node or the other: nothing sent
        raw(cluster, names[3]).delete(names[3])
        assert t.put(ks[3:], list(data[3:]), tags[3:]) == 1  # a new key of a migrating slot: the target
        asking = redis.Redis(port=dst).pipeline(transaction=False)
        asking.execute_command("ASKING")
        asking.exists(names[3])
        assert asking.execute()[1] == 1
        with pytest.raises(redis.exceptions.AskError):  # the source has no such key: it sends us on
            redis.Redis(port=src).exists(names[3])
        out = np.zeros_like(data)
        assert t.get(ks, list(out), tags) == [True] * 4 and np.array_equal(out, data)
        assert t.stats()["errors"] == 0
        # finish the migration: now MOVED re-points the slot
        cli(src, "MIGRATE", "127.0.0.1", str(dst), "", "0", "5000", "KEYS", names[2].decode())
        for node in cluster.primaries():
            cli(node.port, "CLUSTER", "SETSLOT", str(slot), "NODE", dst_id)
        wait_until(lambda: all(t.get(ks, list(out), tags)), 10, "hits through the migrated slot", poll_s=0.1)
        assert np.array_equal(out, data) and owner_port(cluster, names[0]) == dst
