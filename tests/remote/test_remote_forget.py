"""Forgetting a tenant reaches the remote tier: the sweep deletes exactly the values one owner
wrote (any store, any namespace), over a real Redis Cluster; and across a real daemon with
host, disk and the cluster, then a restart, none of the tenant's blocks is readable while
every other tenant's is."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

import kvstore
from kvstore import KVLayout
from kvstore.store.levels.shared import owner_tag
from kvstore.tiers.remote import codec
from kvstore.tiers.remote.naming import name_pattern
from kvstore.tools.bench.redis_local import RedisCluster

from remote_helpers import PAYLOAD, Daemon, keys, owner_port, payloads, tier
from waiting import wait_until

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
ADMIN = "admin-secret"
TOKENS = ('[[tenant]]\nname = "acme"\ntokens = ["tok-acme"]\n\n'
          '[[tenant]]\nname = "globex"\ntokens = ["tok-globex"]\n')


def owned(cluster: RedisCluster, owner: bytes, prefix: str = "kvstore") -> int:
    """Values in the cluster (every primary, asked directly) whose header names ``owner``."""
    found = 0
    for node in cluster.primaries():
        r = redis.Redis(port=node.port)
        for name in r.scan_iter(match=name_pattern(prefix), count=1000):
            head = r.getrange(name, 0, codec.FIXED.size - 1)
            found += codec.is_owned(head, owner)
    return found


def test_a_sweep_deletes_one_owners_values_and_nothing_else(cluster: RedisCluster) -> None:
    t = tier(cluster.url)
    mine, theirs = keys("sweep-mine", 40), keys("sweep-theirs", 30)
    a, b = b"\xaa" * 16, b"\xbb" * 16
    assert t.put(mine, list(payloads(mine)), owners=[a] * len(mine)) == 40
    assert t.put(theirs, list(payloads(theirs)), owners=[b] * len(theirs)) == 30
    # a value of the format before owners (v1 name): never read by this version, never swept
    old = b"kvstore:v1:g1:{" + mine[0].hex().encode() + b"}"
    redis.Redis(port=owner_port(cluster, old)).set(old, b"KVRB\x00\x01" + bytes(100))
    assert t.lookup(mine[:4]) == 4  # a short run: its values are kept for the read that follows
    started = time.perf_counter()
    result = t.forget_owner(a)
    took = time.perf_counter() - started
    assert result.complete and result.deleted == 40 and result.scanned >= 70, result
    outs = np.zeros((40, PAYLOAD), dtype=np.uint8)
    assert t.get(mine, list(outs)) == [False] * 40  # the kept values went with them
    assert t.lookup(mine) == 0
    got = np.zeros((30, PAYLOAD), dtype=np.uint8)
    assert t.get(theirs, list(got)) == [True] * 30 and np.array_equal(got, payloads(theirs))
    assert owned(cluster, a) == 0 and owned(cluster, b) == 30
    assert redis.Redis(port=owner_port(cluster, old)).exists(old) == 1
    print(f"sweep of {result.scanned} names, {result.deleted} deleted: {took * 1000:.1f} ms")
    with pytest.raises(ValueError, match="16 bytes"):
        t.forget_owner(b"short")
    t.close()


def rest(url: str, body: dict[str, object], token: str | None) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json",
                                          **({"authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chain(tokens: list[int], client: kvstore.StoreClient) -> tuple[list[bytes], torch.Tensor]:
    ks = client.block_keys(tokens)
    gen = torch.Generator().manual_seed(len(tokens) + int.from_bytes(ks[0][:4], "little"))
    return ks, torch.randn((len(ks), *LAYOUT.block_shape), generator=gen)


def test_forget_a_tenant_in_host_disk_and_the_cluster_then_restart(cluster: RedisCluster, tmp_path: Path) -> None:
    (tmp_path / "tokens.toml").write_text(TOKENS)
    args = ("--remote-url", cluster.url, "--remote-timeout", "3", "--tokens", str(tmp_path / "tokens.toml"),
            "--token", ADMIN, "--host-mem", "1MiB", "--disk-size", "4MiB")
    daemon = Daemon(tmp_path / "data", *args)
    prompt_a, prompt_g = list(range(1000, 1400)), list(range(1000, 1200))  # 100 and 50 blocks
    try:
        with kvstore.connect(daemon.unix, token="tok-acme", layout=LAYOUT, model_id="m") as acme, \
                kvstore.connect(daemon.unix, token="tok-globex", layout=LAYOUT, model_id="m") as globex:
            ka, data_a = chain(prompt_a, acme)
            kg, data_g = chain(prompt_g, globex)
            acme.put(ka, data_a)
            globex.put(kg, data_g)
            acme.pin(ka[:5])  # pinned, no TTL: a forget takes them all the same
            acme.pin(ka[5:10], ttl_s=600)
            assert acme.flush(10) and globex.flush(10)
            tag = owner_tag("acme")
            wait_until(lambda: owned(cluster, tag) >= len(ka), 20, "acme's blocks in the cluster", poll_s=0.1)
            info = acme.inspect(ka[:1])[0]
            assert info is not None and {"host", "disk", "remote"} <= set(info.tiers) and info.pins == 1

            # a tenant token may not forget another tenant, nor may a caller without a token
            assert rest(f"{daemon.http}/v1/cache/forget", {"tenant": "acme"}, "tok-globex")[0] == 403
            assert rest(f"{daemon.http}/v1/cache/forget", {"tenant": "acme"}, None)[0] == 401
            assert rest(f"{daemon.http}/v1/cache/forget", {"tenant": "nobody"}, ADMIN)[0] == 404
            status, report = rest(f"{daemon.http}/v1/cache/forget", {"tenant": "acme"}, ADMIN)
            assert status == 200 and report["complete"], report
            deleted = report["deleted"]
            assert isinstance(deleted, dict)
            assert deleted["host"] > 0 and deleted["disk"] == len(ka) and deleted["remote"] == len(ka), report
            assert report["num_blocks"] == len(ka) and report["pins_released"] == 10
            assert owned(cluster, tag) == 0
            assert acme.lookup(ka).num_blocks == 0
            with pytest.raises(KeyError):
                acme.get(ka[:1])
            assert torch.equal(globex.get(kg), data_g)
        daemon.stop()
        daemon = Daemon(tmp_path / "data", *args)  # the disk catalog is the truth after a restart
        with kvstore.connect(daemon.unix, token="tok-acme", layout=LAYOUT, model_id="m") as acme, \
                kvstore.connect(daemon.unix, token="tok-globex", layout=LAYOUT, model_id="m") as globex:
            assert acme.lookup(ka).num_blocks == 0
            assert acme.inspect(ka) == [None] * len(ka)
            with pytest.raises(KeyError):
                acme.get(ka[-1:])
            assert globex.lookup(kg).num_blocks == len(kg)
            assert torch.equal(globex.get(kg), data_g)  # other tenants untouched
        assert owned(cluster, tag) == 0 and owned(cluster, owner_tag("globex")) == len(kg)
    finally:
        daemon.stop()


def test_a_block_promoted_from_the_cluster_is_filed_under_its_owner_and_forgotten(cluster: RedisCluster,
                                                                                  tmp_path: Path) -> None:
    """Another store wrote the blocks; this one promotes them from the cluster into host RAM and
    files them under the tenant their values name, known or not: a forget takes them."""
    from kvstore import StoreConfig, TieredStore
    from kvstore.keys import BlockHasher

    def store(name: str) -> TieredStore:
        return TieredStore(StoreConfig(layout=LAYOUT, model_id="m", host_bytes=1 << 20,
                                       remote_url=cluster.url, remote_prefix=f"promo-{name}"))

    writer = store("x")
    tokens = list(range(5000, 5040))
    keys = writer.block_keys(tokens, "acme")
    data = torch.randn(len(keys), *LAYOUT.block_shape)
    writer.put(keys, data, tenant="acme")
    assert writer.flush(20)
    writer.close()
    met, unmet = store("x"), store("x")
    met.know_tenant("acme")  # as a daemon's hello or block_keys("...", "acme") tells it
    for reader in (met, unmet):
        assert torch.equal(reader.get(keys), data)  # read from the cluster, promoted into host RAM
        assert reader.lookup(keys).tiers == ("host",) * len(keys)
    assert {i.tenant for i in met.inspect(keys)} == {"acme"}  # type: ignore[union-attr]
    assert {i.tenant for i in unmet.inspect(keys)} == {"#" + owner_tag("acme").hex()}  # type: ignore[union-attr]
    report = unmet.forget_tenant("acme")
    assert report.deleted["host"] == len(keys) and report.deleted["remote"] == len(keys)
    assert unmet.lookup(keys).num_blocks == 0
    report = met.forget_tenant("acme")  # the remote is empty now; its own host copies go too
    assert report.deleted == {"host": len(keys), "remote": 0} and met.lookup(keys).num_blocks == 0
    assert BlockHasher(met.namespace).block_keys(tokens, "acme") == keys
    met.close()
    unmet.close()
