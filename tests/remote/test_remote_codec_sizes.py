"""remote_codec="int8" against a real Redis Cluster: the ratio comes from the values' real
lengths (STRLEN on the primaries), not from a formula; both stores read their own blocks back."""

from __future__ import annotations

import torch
from redis.cluster import ClusterNode
from redis.cluster import RedisCluster as ClusterClient

from kvstore import KVLayout
from kvstore.codecs import get_codec
from kvstore.tools.bench.redis_local import RedisCluster

from factories import make_store

# The benchmark's geometry: 192 KiB fp16 blocks, 101,408 bytes as int8.
LAYOUT = KVLayout(num_layers=24, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)


def _value_lengths(cluster: RedisCluster, prefix: str) -> list[int]:
    client = ClusterClient(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in cluster.nodes[:3]])
    try:
        names = list(client.scan_iter(match=f"{prefix}:*", target_nodes=ClusterClient.PRIMARIES))
        return sorted(int(client.strlen(name)) for name in names)
    finally:
        client.close()


def test_int8_values_are_half_the_length_measured_in_redis(cluster: RedisCluster) -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randn((4, *LAYOUT.block_shape), generator=gen).to(LAYOUT.dtype)
    got = {}
    for codec in ("none", "int8"):
        with make_store(None, host_blocks=200, layout=LAYOUT, remote_url=cluster.url, remote_codec=codec) as store:
            keys = store.block_keys(list(range(4 * LAYOUT.block_size)))
            store.put(keys, blocks)
            assert store.flush(10)
        with make_store(None, host_blocks=200, layout=LAYOUT, remote_url=cluster.url, remote_codec=codec) as reader:
            assert reader.lookup(keys).tiers == ("remote",) * 4
            got[codec] = reader.get(keys)
    raw, int8 = _value_lengths(cluster, "kvstore"), _value_lengths(cluster, "kvstore-int8")
    assert len(raw) == len(int8) == 4 and len(set(raw)) == len(set(int8)) == 1, (raw, int8)
    encoded = get_codec("int8").encoded_bytes(LAYOUT)
    assert 0 < int8[0] - encoded < 512 and 0 < raw[0] - LAYOUT.bytes_per_block < 512  # + the value header
    assert 1.92 < raw[0] / int8[0] < 1.95, (raw[0], int8[0])
    assert torch.equal(got["none"], blocks)
    err = (got["int8"].float() - blocks.float()).abs()
    amax = blocks.float().abs().amax(dim=-1, keepdim=True)
    assert bool((err <= amax / 254 * 1.01 + amax * 2**-11).all())  # + float16's rounding of the output
