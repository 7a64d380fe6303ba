"""A remote hit as the store's callers make it, counted on a real cluster: the commands every
node ran (Redis ``INFO commandstats``), and the store's own ``round_trips`` and hint counters.

One round trip per primary for a hit: a fetch or get sends one GET per block and no EXISTS;
a lookup either GETs a short run (its values kept for the fetch that follows) or asks
EXISTS of a long one, and a repeated lookup answers from its hints without asking at all.
"""

from __future__ import annotations

import time

import pytest
import redis
import torch

from kvstore.store import TieredStore
from kvstore.tiers.remote import RemoteTier
from kvstore.tiers.remote.hints import HINT_TTL_S
from kvstore.tools.bench.redis_local import RedisCluster, cli

from factories import blocks_for, chain, make_store
from waiting import wait_until


def remote(cluster: RedisCluster, **overrides: object) -> TieredStore:
    overrides.setdefault("remote_timeout_s", 3.0)  # generous: a loaded 2-core CI machine
    overrides.setdefault("promotion", "never")  # every read of the test goes to the remote
    return make_store(None, host_blocks=16, remote_url=cluster.url, **overrides)


def tier_of(store: TieredStore) -> RemoteTier:
    return store.level("remote").tier  # type: ignore[union-attr]


def reset_commandstats(cluster: RedisCluster) -> None:
    for node in cluster.nodes:
        if node.alive:
            cli(node.port, "CONFIG", "RESETSTAT")


def calls(cluster: RedisCluster, command: str) -> int:
    """How many times the live nodes ran ``command`` since the last reset (Redis's own count)."""
    total = 0
    for node in cluster.nodes:
        if not node.alive:
            continue
        for line in cli(node.port, "INFO", "commandstats").splitlines():
            if line.startswith(f"cmdstat_{command}:"):
                total += int(line.split("calls=")[1].split(",")[0])
    return total


def written(cluster: RedisCluster, num_blocks: int, salt: int) -> tuple[list[bytes], torch.Tensor]:
    """A chain another store ("node A") put, now only in the cluster."""
    with remote(cluster) as writer:
        keys = chain(writer, num_blocks, salt=salt)
        blocks = blocks_for(keys)
        writer.put(keys, blocks)
        assert writer.flush(10)
    return keys, blocks


def test_a_fetch_of_remote_blocks_is_one_get_each_and_no_exists(cluster: RedisCluster) -> None:
    keys, blocks = written(cluster, 24, salt=1)
    with remote(cluster) as reader:
        trips = reader.stats()["remote"]["round_trips"]
        reset_commandstats(cluster)
        into = torch.zeros_like(blocks)
        assert reader.fetch(keys, into=into).result(timeout=10).num_blocks == 24
        assert torch.equal(into, blocks)
        assert torch.equal(reader.get(keys), blocks)
        assert calls(cluster, "get") == 2 * 24 and calls(cluster, "exists") == 0
        assert reader.stats()["remote"]["round_trips"] == trips + 2  # one each, the primaries in parallel


def test_a_lookup_then_fetch_of_a_short_run_costs_one_round_trip(cluster: RedisCluster) -> None:
    keys, blocks = written(cluster, 8, salt=2)
    with remote(cluster) as reader:
        reset_commandstats(cluster)
        before = reader.stats()["remote"]
        assert reader.lookup(keys).tiers == ("remote",) * 8  # GETs: the values wait for the fetch
        into = torch.zeros_like(blocks)
        assert reader.fetch(keys, into=into).result(timeout=10).num_blocks == 8
        assert torch.equal(into, blocks)
        after = reader.stats()["remote"]
        assert calls(cluster, "get") == 8 and calls(cluster, "exists") == 0
        assert after["round_trips"] == before["round_trips"] + 1
        assert after["kept_used"] == before["kept_used"] + 8


def test_a_long_run_is_asked_once_and_then_answered_by_its_hints(cluster: RedisCluster) -> None:
    keys, blocks = written(cluster, 12, salt=3)
    with remote(cluster) as reader:
        tier_of(reader).lookup_get_bytes = 0  # every run is long: EXISTS, nothing kept
        reset_commandstats(cluster)
        before = reader.stats()["remote"]
        assert reader.lookup(keys).num_blocks == 12
        assert reader.lookup(keys).num_blocks == 12  # the engine asks again each step it waits
        into = torch.zeros_like(blocks)
        assert reader.fetch(keys, into=into).result(timeout=10).num_blocks == 12
        assert torch.equal(into, blocks)
        after = reader.stats()["remote"]
        assert calls(cluster, "exists") == 12 and calls(cluster, "get") == 12
        assert after["round_trips"] == before["round_trips"] + 2  # the first lookup, the fetch
        assert after["hint_hits"] == before["hint_hits"] + 12 and after["kept_used"] == before["kept_used"]


def test_a_warm_miss_costs_no_round_trip_until_its_hint_expires(cluster: RedisCluster) -> None:
    with remote(cluster) as reader, remote(cluster) as other:
        keys = chain(reader, 6, salt=4)
        assert reader.lookup(keys).num_blocks == 0  # asked: the cluster has none of it
        reset_commandstats(cluster)
        before = reader.stats()["remote"]
        for _ in range(5):
            assert reader.lookup(keys).num_blocks == 0
            with pytest.raises(KeyError):
                reader.get(keys)
        after = reader.stats()["remote"]
        assert after["round_trips"] == before["round_trips"]
        assert after["hint_hits"] - before["hint_hits"] == 5 * (1 + 6)  # a lookup's miss, a get's six
        assert calls(cluster, "get") == calls(cluster, "exists") == 0
        other.put(keys, blocks_for(keys))  # another node writes the prefix
        assert other.flush(10)
        time.sleep(HINT_TTL_S)  # the TTL under test: within it the miss stands; after it the write is seen
        assert reader.lookup(keys).tiers == ("remote",) * 6
        assert torch.equal(reader.get(keys), blocks_for(keys))


def test_a_primary_killed_between_lookup_and_fetch_is_read_from_its_replica(cluster: RedisCluster) -> None:
    """Blocks on the dead primary are read from its replica (READONLY) at once: nothing raised,
    the bytes put; its replica then takes over. (Last in the module: the cluster, the
    module's own, keeps one primary fewer.)"""
    keys, blocks = written(cluster, 24, salt=5)
    with remote(cluster, remote_timeout_s=0.5) as reader, remote(cluster, remote_timeout_s=0.5) as short:
        tier = tier_of(reader)
        tier.lookup_get_bytes = 0  # EXISTS: nothing kept, the fetch must GET
        owners = [tier.owner(name) for name in tier.names(keys)]
        victim_port = owners[5][1]  # type: ignore[index]
        victim = next(n for n in cluster.nodes if n.port == victim_port)
        assert reader.lookup(keys).num_blocks == 24
        assert short.lookup(keys[:4]).num_blocks == 4  # a short run: its values are kept
        assert redis.Redis(port=victim_port).execute_command("WAIT", 1, 5000) == 1, "the replica holds them"
        victim.kill()
        into = torch.zeros_like(blocks)
        got = reader.fetch(keys, into=into).result(timeout=10)
        assert got.num_blocks == 24 and got.tiers == ("remote",) * 24
        assert torch.equal(into, blocks)
        kept = torch.zeros_like(blocks[:4])
        n = short.fetch(keys[:4], into=kept).result(timeout=10).num_blocks
        assert torch.equal(kept[:n], blocks[:n])  # kept values are checked again: the bytes put
        s = tier.stats()
        assert s["replica_reads"] >= 1
        assert s["errors"] >= 1 and s["errors_connection"] + s["errors_timeout"] + s["errors_unavailable"] >= 1
        cluster.wait_failover(victim)
        wait_until(lambda: reader.fetch(keys, into=into).result(timeout=10).num_blocks == 24, 20,
                   "the promoted replica serving the blocks", poll_s=0.2)
        assert torch.equal(into, blocks)
