"""The remote tier as the store's shared level: two stores ("two nodes") share blocks through
a real Redis Cluster; tenants never meet; the store keeps working when Redis does not."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvstore import ConfigError, StoreConfig
from kvstore.codecs.int8 import Int8Codec
from kvstore.store import TieredStore
from kvstore.store.levels.coding import LevelCodec
from kvstore.store.levels.remote_level import RemoteLevel
from kvstore.tiers.remote import RemoteTier
from kvstore.tiers.remote.hints import HINT_TTL_S
from kvstore.tools.bench.redis_local import RedisCluster, cli, free_port

from factories import SLOT, SMALL_LAYOUT, blocks_for, chain, make_store


def remote(cluster: RedisCluster, tmp_path: Path | None = None, host_blocks: int = 16,
           disk_blocks: int = 0, **overrides: object) -> TieredStore:
    overrides.setdefault("remote_timeout_s", 3.0)  # generous: a loaded 2-core CI machine
    return make_store(tmp_path, host_blocks=host_blocks, disk_blocks=disk_blocks, remote_url=cluster.url,
                      **overrides)


def test_two_stores_share_a_prefix_through_the_cluster(cluster: RedisCluster, tmp_path: Path) -> None:
    node_a = remote(cluster, tmp_path, disk_blocks=32)
    node_b = remote(cluster)  # separate local tiers, nothing in them
    try:
        keys = chain(node_a, 12, salt=1)
        node_a.put(keys, blocks_for(keys))  # lands in A's host now, remote in the background
        assert node_a.flush(timeout=10)
        assert node_a.levels == ("host", "disk", "remote") and node_b.levels == ("host", "remote")
        m = node_b.lookup(keys)
        assert m.num_blocks == 12 and set(m.tiers) == {"remote"}
        assert torch.equal(node_b.get(keys), blocks_for(keys))  # exactly the bytes A put
        m = node_b.lookup(keys)  # promoted into B's host RAM by the get
        assert m.num_blocks == 12 and set(m.tiers) == {"host"}
        longer = chain(node_b, 16, salt=1)  # the same prompt, 4 more blocks B computes itself
        node_b.put(longer[12:], blocks_for(longer[12:]))
        assert node_b.lookup(longer).tiers == ("host",) * 16
        s = node_b.stats()["remote"]
        assert s["hits"] >= 24 and s["errors"] == 0 and s["nodes_up"] == 3 and s["capacity_bytes"] > 0
        node_a.check_integrity()
        node_b.check_integrity()
    finally:
        node_a.close()
        node_b.close()


def test_lookup_continues_into_remote_where_the_local_run_ends(cluster: RedisCluster) -> None:
    with remote(cluster) as node_a, remote(cluster) as node_b:
        keys = chain(node_a, 10, salt=2)
        node_a.put(keys, blocks_for(keys))
        assert node_a.flush(10)
        node_b.put(keys[:3], blocks_for(keys[:3]))
        m = node_b.lookup(keys)
        assert m.tiers == ("host",) * 3 + ("remote",) * 7
        into = torch.full((10, *node_b.layout.block_shape), float("nan"))
        result = node_b.fetch(keys, into=into).result(timeout=10)
        assert result.num_blocks == 10 and result.tiers == ("host",) * 3 + ("remote",) * 7
        assert torch.equal(into, blocks_for(keys))
        node_b.check_integrity()


def test_a_corrupt_remote_block_ends_the_run_and_is_never_served(cluster: RedisCluster) -> None:
    with remote(cluster) as node_a, remote(cluster) as node_b:
        keys = chain(node_a, 6, salt=3)
        node_a.put(keys, blocks_for(keys))
        assert node_a.flush(10)
        tier = node_a.level("remote").tier  # type: ignore[union-attr]
        name = tier.names(keys[3:4])[0]
        port = next(n.port for n in cluster.primaries()
                    if cli(n.port, "EXISTS", name.decode()).strip() == "1")
        cli(port, "SETRANGE", name.decode(), "200", "X")
        into = torch.zeros((6, *node_b.layout.block_shape))
        result = node_b.fetch(keys, into=into).result(timeout=10)
        assert result.num_blocks == 3
        assert torch.equal(into[:3], blocks_for(keys[:3]))
        assert not into[3].any(), "the rejected value must never reach the caller's memory"
        with pytest.raises(KeyError):
            node_b.get(keys)
        assert node_b.stats()["remote"]["errors"] == 1
        assert node_b.lookup(keys).num_blocks == 3  # the bad value was deleted


def test_demote_mode_sends_only_blocks_that_leave_the_node(cluster: RedisCluster, tmp_path: Path) -> None:
    with remote(cluster, tmp_path, host_blocks=4, disk_blocks=4, remote_writes="demote") as node_a, \
            remote(cluster) as node_b:
        first = chain(node_a, 4, salt=4)
        node_a.put(first, blocks_for(first))
        assert node_a.flush(10) and node_b.lookup(first).num_blocks == 0  # still local only
        second = chain(node_a, 4, salt=5)
        node_a.put(second, blocks_for(second))  # host -> disk: still on the node
        assert node_a.flush(10) and node_b.lookup(first).num_blocks == 0
        third = chain(node_a, 4, salt=6)
        node_a.put(third, blocks_for(third))  # disk drops the first chain: it goes remote
        assert node_a.flush(10)
        time.sleep(HINT_TTL_S)  # B's own misses of it stand that long: another node's write shows by then
        assert node_b.lookup(first).tiers == ("remote",) * 4
        assert torch.equal(node_b.get(first), blocks_for(first))
        assert node_b.lookup(third).num_blocks == 0
    with remote(cluster, host_blocks=8, remote_writes="demote") as node_c:
        fourth = chain(node_c, 4, salt=7)
        node_c.put(fourth, blocks_for(fourth))
    with remote(cluster) as node_d:  # a host-only store offers what it holds when it closes
        assert node_d.lookup(fourth).tiers == ("remote",) * 4


def test_tenants_never_share_a_remote_block(cluster: RedisCluster, tmp_path: Path) -> None:
    """Identical prompts of two tenants: different keys in every tier, across a restart."""
    with remote(cluster, tmp_path, disk_blocks=16) as node_a:
        acme = chain(node_a, 5, salt=8, tenant="acme")
        node_a.put(acme, blocks_for(acme), tenant="acme")
        assert node_a.flush(10)
    with remote(cluster, tmp_path, disk_blocks=16) as reopened, remote(cluster) as node_b:
        globex = chain(reopened, 5, salt=8, tenant="globex")
        assert set(globex).isdisjoint(acme)
        for store in (reopened, node_b):
            assert store.lookup(globex).num_blocks == 0
            with pytest.raises(KeyError):
                store.get(globex)
        assert reopened.lookup(acme).tiers == ("disk",) * 5
        assert node_b.lookup(acme).tiers == ("remote",) * 5
        node_b.put(globex, blocks_for(globex) * 2, tenant="globex")  # other bytes, same prompt
        assert node_b.flush(10)
        assert torch.equal(reopened.get(acme), blocks_for(acme))
    with remote(cluster) as node_c:
        assert torch.equal(node_c.get(acme), blocks_for(acme))
        assert torch.equal(node_c.get(globex), blocks_for(globex) * 2)


def test_the_store_works_locally_while_redis_is_down(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port(bus=False)}"
    with make_store(tmp_path, host_blocks=8, disk_blocks=8, remote_url=url, remote_timeout_s=0.2) as store:
        keys = chain(store, 12, salt=9)
        started = time.monotonic()
        store.put(keys, blocks_for(keys))
        assert store.flush(10)
        assert store.lookup(keys).num_blocks == 12  # host and disk, no remote needed
        assert torch.equal(store.get(keys), blocks_for(keys))
        other = chain(store, 3, salt=10)
        assert store.lookup(other).num_blocks == 0
        with pytest.raises(KeyError):
            store.get(other)
        assert time.monotonic() - started < 5
        s = store.stats()["remote"]
        assert s["errors"] > 0 and s["dropped"] == 12 and s["nodes_up"] == 0
        store.check_integrity()


def test_config_validates_the_url_and_never_shows_the_password() -> None:
    from factories import SMALL_LAYOUT

    secret = "hunter2-secret"
    cfg = StoreConfig(layout=SMALL_LAYOUT, host_bytes=4 * SLOT,
                      remote_url=f"redis+cluster://u:{secret}@127.0.0.1:1,127.0.0.1:2")
    assert secret not in repr(cfg)
    with pytest.raises(ConfigError) as e:
        StoreConfig(layout=SMALL_LAYOUT, host_bytes=4 * SLOT, remote_url=f"redis://u:{secret}@h:bad")
    assert secret not in str(e.value) and "***" in str(e.value)
    with pytest.raises(ConfigError, match="remote_writes"):
        StoreConfig(layout=SMALL_LAYOUT, host_bytes=4 * SLOT, remote_url="redis://h:1", remote_writes="all")


def test_a_lossy_remote_codec_is_marked_and_refused_by_exact_reads(cluster: RedisCluster) -> None:
    with remote(cluster, remote_codec="int8") as node_a, remote(cluster, remote_codec="int8") as node_b, \
            remote(cluster) as raw_reader:
        keys = chain(node_a, 4, salt=11)
        node_a.put(keys, blocks_for(keys))
        assert node_a.flush(10)
        m = node_b.lookup(keys)
        assert m.tiers == ("remote",) * 4 and m.lossy == (True,) * 4
        assert node_b.lookup(keys, exact=True).num_blocks == 0
        with pytest.raises(KeyError):
            node_b.get(keys, exact=True)
        got = node_b.get(keys)  # int8 absmax: close to, not equal to, the bytes put
        assert torch.allclose(got, blocks_for(keys), atol=0.05, rtol=0.05)
        assert node_b.view.block_info(keys[0])["lossy"]  # type: ignore[index]
        assert raw_reader.lookup(keys).num_blocks == 0  # another codec names another layout: a miss
        assert node_b.stats()["remote"]["codec"] == "int8"


def test_a_block_the_remote_codec_refuses_drops_only_itself(cluster: RedisCluster) -> None:
    with remote(cluster, remote_codec="int8") as node_a, remote(cluster, remote_codec="int8") as node_b:
        keys = chain(node_a, 8, salt=13)
        blocks = blocks_for(keys)
        blocks[7].view(-1)[0] = float("nan")  # int8 absmax cannot scale a NaN
        node_a.put(keys, blocks)
        assert node_a.flush(10)
        s = node_a.stats()["remote"]
        assert s["dropped"] == 1 and s["bytes_written"] == 7 * node_a.level("remote").coding.stored_bytes  # type: ignore[union-attr]
        assert node_b.lookup(keys).tiers == ("remote",) * 7
        assert torch.allclose(node_b.get(keys[:7]), blocks[:7], atol=0.05, rtol=0.05)


class CountingInt8(Int8Codec):
    """The real int8 codec, counting the blocks it quantizes."""

    num_encoded = 0

    def encode(self, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self.num_encoded += blocks.shape[0]
        return super().encode(blocks, out)


def test_blocks_past_the_queue_are_never_encoded(cluster: RedisCluster) -> None:
    """A demoting store's close() offers all of host RAM at once: the level claims the
    queue's room first and quantizes only the blocks that fit."""
    codec = CountingInt8()
    coding = LevelCodec(codec, SMALL_LAYOUT)
    tier = RemoteTier(cluster.url, coding.stored_bytes, "counting-int8", queue_blocks=8, timeout_s=3.0)
    level = RemoteLevel(tier, "demote", coding)
    try:
        keys = [bytes([i]) * 32 for i in range(64)]
        rows = blocks_for(keys).view(torch.uint8).view(64, -1)
        level.offer(keys, list(rows))
        assert codec.num_encoded == 8
        assert level.flush(10)
        s = level.stats()
        assert s["dropped"] == 56 and s["bytes_written"] == 8 * coding.stored_bytes
        assert tier.exists(keys) == 8
    finally:
        level.close()


def test_a_remote_value_the_codec_refuses_is_counted_and_deleted(cluster: RedisCluster) -> None:
    with remote(cluster, remote_codec="int8") as node_a, remote(cluster, remote_codec="int8") as node_b:
        keys = chain(node_a, 4, salt=14)
        node_a.put(keys, blocks_for(keys))
        assert node_a.flush(10)
        tier = node_a.level("remote").tier  # type: ignore[union-attr]
        tier.delete(keys[1:2])  # intact as a value, but no int8 block inside: a foreign writer's
        assert tier.put(keys[1:2], [torch.zeros(tier.payload_bytes, dtype=torch.uint8)]) == 1
        into = torch.zeros((4, *node_b.layout.block_shape))
        assert node_b.fetch(keys, into=into).result(timeout=10).num_blocks == 1
        s = node_b.level("remote").tier.stats()  # type: ignore[union-attr]
        assert s["errors"] == s["errors_corrupt"] == s["corrupt_codec"] == 1
        assert node_b.lookup(keys).num_blocks == 1  # the refused value was deleted


def test_listeners_hear_the_blocks_this_store_wrote_remote(cluster: RedisCluster) -> None:
    heard: list[tuple[str, list[bytes]]] = []

    class Listener:
        def blocks_stored(self, tier: str, keys: list[bytes], parents: list[bytes | None],
                      groups: list[int | None]) -> None:
            heard.append((tier, keys))

        def blocks_removed(self, tier: str, keys: list[bytes], groups: list[int | None]) -> None:
            heard.append((f"-{tier}", keys))

    with remote(cluster) as node_a:
        node_a.add_listener(Listener())
        keys = chain(node_a, 5, salt=12)
        node_a.put(keys, blocks_for(keys))
        assert node_a.flush(10)
        remote_keys = [k for tier, ks in heard if tier == "remote" for k in ks]
        assert sorted(remote_keys) == sorted(keys)
        assert ("host", keys) in heard
        node_a.put(keys, blocks_for(keys))  # held already: no second announcement
        assert node_a.flush(10) and len([t for t, _ in heard if t == "remote"]) == 1
