"""The vLLM connector's parts that need no vLLM: settings, the paged copy, the guarded store.

(The connector itself runs against a real vLLM in tests_vllm/, `make test-vllm`.)
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout
from kvstore.config import StoreSettings
from kvstore.errors import ConfigError, DaemonUnreachableError, LayoutMismatchError
from kvstore.integrations.vllm.backend import GuardedStore
from kvstore.integrations.vllm.paged import PagedKV
from kvstore.integrations.vllm.settings import ConnectorSettings
from tests.daemon.daemon_helpers import DaemonProc

from waiting import wait_until

# Like vLLM's CPU backend: per layer [num_blocks, kv_heads, block, 2 * head_dim], blocks contiguous.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=8, dtype=torch.float32)
LAYER_BYTES = 2 * 8 * 2 * 4 * 4
NAMES = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def caches(num_blocks: int = 10, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn((num_blocks, 2, 8, 8), generator=gen) for name in NAMES}


def test_settings_validate_and_never_show_the_token() -> None:
    s = ConnectorSettings.from_extra_config({"store_url": "unix:///tmp/s.sock", "token": "sekrit", "host_bytes": "16MiB"})
    assert s.is_daemon and s.store_settings.host_bytes == 16 << 20 and "sekrit" not in s.describe() + repr(s.describe())
    assert not ConnectorSettings.from_extra_config(None).is_daemon
    with pytest.raises(ConfigError, match=r"unknown kv_connector_extra_config keys \['stor'\]"):
        ConnectorSettings.from_extra_config({"stor": "unix:///x"})
    with pytest.raises(ConfigError, match="store_url must be"):
        ConnectorSettings(store_url="http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="needs disk_bytes"):
        ConnectorSettings.from_extra_config({"disk_path": "/tmp/kv"})
    with pytest.raises(ConfigError, match="async_tiers"):
        ConnectorSettings(async_tiers=("tape",))
    with pytest.raises(ConfigError, match="async_when_idle must be true or false"):
        ConnectorSettings(async_when_idle="yes")  # type: ignore[arg-type]
    assert ConnectorSettings(async_tiers="remote").async_tiers == ("remote",)
    assert ConnectorSettings().async_tiers == ("disk", "remote")


def test_the_old_store_key_still_names_the_daemon_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="kvstore.integrations.vllm"):
        s = ConnectorSettings.from_extra_config({"store": "unix:///tmp/s.sock"})
    assert s.store_url == "unix:///tmp/s.sock" and s.is_daemon
    assert "key 'store' is spelled 'store_url' now" in caplog.text


def test_every_store_setting_is_an_extra_config_key_and_hash_algo_is_one_setting(tmp_path: Path) -> None:
    s = ConnectorSettings.from_extra_config({"disk_path": str(tmp_path), "disk_bytes": "2MiB", "disk_codec": "int8",
                                             "promotion": "never", "remote_prefix": "blue", "hash_algo": "xxh3_128"})
    assert s.store_settings == StoreSettings(disk_path=tmp_path, disk_bytes=2 << 20, disk_codec="int8",
                                             promotion="never", remote_prefix="blue", hash_algo="xxh3_128")
    assert s.hash_algo == "xxh3_128" and "disk_codec" not in {f.name for f in fields(s)}
    assert ConnectorSettings(store_settings=StoreSettings(hash_algo="xxh3_128")).hash_algo == "xxh3_128"
    assert ConnectorSettings.from_extra_config({"host_bytes": "2MiB"}).store_settings == StoreSettings(host_bytes=2 << 20)
    assert "hash_algo" not in {f.name for f in fields(ConnectorSettings)}  # one setting: the store's
    assert ConnectorSettings.from_extra_config({"hash_algo": "xxh3_128"}).store_settings.hash_algo == "xxh3_128"
    with pytest.raises(ConfigError, match=r"disk_codec must be one of"):
        ConnectorSettings.from_extra_config({"disk_codec": "zstd"})


@pytest.mark.parametrize(("extra", "match"), [
    ({"store_url": None}, "store_url must be"), ({"store_url": 5}, "store_url must be"),
    ({"store_url": "tcp://"}, "store_url must be"), ({"store_url": "tcp://host"}, "store_url must be"),
    ({"store_url": "unix://"}, "store_url must be"), ({"store": "unix://"}, "store_url must be"),
    ({"store": "unix:///a", "store_url": "unix:///b"}, "has both 'store' and 'store_url'"),
    ({"async_tiers": 5}, "async_tiers must be"), ({"async_tiers": [None]}, "async_tiers must be"),
    ({"hash_algo": ["sha256"]}, "hash_algo must be"), ({"write_policy": ["write_back"]}, "write_policy must be"),
    ({"retry_s": float("nan")}, "retry_s must be a positive, finite"), ({"timeout_s": float("inf")}, "timeout_s"),
    ({"lookup_timeout_s": 0}, "lookup_timeout_s"), ({"host_bytes": None}, "host_bytes: size None"),
    ({"disk_path": 3, "disk_bytes": "1MiB"}, "disk_path must be"), ({"remote_url": ""}, "remote_url must be"),
    ({"model_id": ["m"]}, "model_id must be"), ({"token": 1234}, "token must be a string, got a int"),
])
def test_a_bad_setting_is_a_config_error_naming_it(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        ConnectorSettings.from_extra_config(extra)
    assert "1234" not in str(caught.value)  # a token never shows


def test_paged_gather_then_scatter_moves_whole_blocks_per_layer() -> None:
    src, dst = caches(seed=1), {n: torch.zeros(10, 2, 8, 8) for n in NAMES}
    paged_src, paged_dst = PagedKV(src, NAMES, LAYOUT, LAYER_BYTES), PagedKV(dst, NAMES, LAYOUT, LAYER_BYTES)
    staging = paged_src.staging(3)
    assert tuple(staging.shape) == (3, *LAYOUT.block_shape)
    for name in NAMES:
        paged_src.gather_layer(name, torch.tensor([3, 7, 1]), staging)
    for i, block in enumerate((3, 7, 1)):  # layer l of kvstore block i is vLLM block `block` of layer l
        parts = staging[i].reshape(2, -1)
        for layer, name in enumerate(NAMES):
            assert torch.equal(parts[layer], src[name][block].flatten())
    for name in NAMES:
        paged_dst.scatter_layer(name, torch.tensor([0, 5, 2]), staging)
    for name in NAMES:
        assert torch.equal(dst[name][[0, 5, 2]], src[name][[3, 7, 1]])
        assert dst[name][[1, 3, 4, 6, 7, 8, 9]].abs().sum() == 0  # nothing else written


def test_staging_buffers_are_reused_warm() -> None:
    paged = PagedKV(caches(), NAMES, LAYOUT, LAYER_BYTES)
    buf = paged.take_staging(3)
    assert tuple(buf.shape) == (3, *LAYOUT.block_shape)
    paged.give_staging(buf)
    assert paged.take_staging(2) is buf  # (the pool's rules: tests/store/test_buffer_pool.py)
    assert paged.take_staging(2) is not buf


def test_paged_refuses_a_layout_whose_blocks_are_not_contiguous() -> None:
    kv = {n: torch.zeros(2, 10, 8, 8).transpose(0, 1) for n in NAMES}  # [blocks, 2, ...] with K/V outermost
    with pytest.raises(LayoutMismatchError, match="not one contiguous payload"):
        PagedKV(kv, NAMES, LAYOUT, LAYER_BYTES)
    with pytest.raises(LayoutMismatchError, match="no KV cache for layers"):
        PagedKV({NAMES[0]: caches()[NAMES[0]]}, NAMES, LAYOUT, LAYER_BYTES)


def test_guarded_store_embedded_round_trip(tmp_path: Path) -> None:
    settings = ConnectorSettings.from_extra_config({"host_bytes": "1MiB", "disk_path": str(tmp_path / "kv"),
                                                    "disk_bytes": "1MiB"})
    store = GuardedStore(settings, LAYOUT, "m")
    keys = store.block_keys(list(range(24)), "")
    assert keys is not None and len(keys) == 3
    blocks = torch.randn(3, *LAYOUT.block_shape)
    assert store.try_put(keys, blocks)
    assert store.lookup(keys).num_blocks == 3
    out = torch.empty_like(blocks)
    assert store.fetch(keys, out).result(10).num_blocks == 3 and torch.equal(out, blocks)
    other = GuardedStore(settings, LAYOUT, "m")  # the worker side of the same process: same store
    assert other.lookup(keys).num_blocks == 3
    other.close()
    assert store.lookup(keys).num_blocks == 3  # still open for the first user
    store.close()
    reopened = GuardedStore(settings, LAYOUT, "m")  # closed by its last user: written back to disk
    assert reopened.lookup(keys).tiers == ("disk",) * 3
    reopened.close()


def test_embedded_stores_of_two_nodes_share_blocks_through_a_remote_tier(tmp_path: Path) -> None:
    from kvstore.tools.bench.redis_local import RedisServer
    from tests.remote.conftest import require_redis

    require_redis()
    redis = RedisServer.start(tmp_path / "redis")
    try:
        url = redis.url
        settings = ConnectorSettings.from_extra_config({"host_bytes": "1MiB", "remote_url": url})
        assert url not in settings.describe() and "remote tier" in settings.describe()
        writer = GuardedStore(settings, LAYOUT, "m")
        keys = writer.block_keys(list(range(24)), "")
        assert keys is not None
        blocks = torch.randn(3, *LAYOUT.block_shape)
        assert writer.try_put(keys, blocks)
        writer.close()  # the last user of this process's store: it flushes to the remote tier
        # another node: its own (empty) local tiers, the same remote tier
        reader = GuardedStore(ConnectorSettings.from_extra_config({"host_bytes": "1MiB", "remote_url": url}), LAYOUT, "m")
        assert reader.lookup(keys).tiers == ("remote",) * 3
        out = torch.empty_like(blocks)
        assert reader.fetch(keys, out).result(10).num_blocks == 3 and torch.equal(out, blocks)
        reader.close()
    finally:
        redis.close()


def test_guarded_store_turns_a_dead_daemon_into_misses(tmp_path: Path) -> None:
    daemon = DaemonProc(tmp_path / "data", host_mem="2MiB", disk="2MiB")
    store = GuardedStore(ConnectorSettings(store_url=daemon.unix, retry_s=30), LAYOUT, "m")
    keys = store.block_keys(list(range(16)), "tenant-a")
    assert keys is not None
    blocks = torch.randn(2, *LAYOUT.block_shape)
    assert store.try_put(keys, blocks) and store.lookup(keys).num_blocks == 2
    daemon.stop()
    daemon.start()  # a restart under a live connection: a fetch reconnects at once and retries
    out = torch.empty_like(blocks)
    assert store.fetch(keys, out).result(10).num_blocks == 2 and torch.equal(out, blocks)
    assert store.lookup(keys).num_blocks == 2
    daemon.kill9()
    assert store.lookup(keys).num_blocks == 0 and store.failures >= 1
    assert store.fetch(keys, out).result(10).num_blocks == 0
    assert not store.try_put(keys, blocks)
    daemon.start()  # back on the same socket: a fetch reconnects (the background waits out its backoff)
    assert store.fetch(keys, out).result(10).num_blocks == 2 and torch.equal(out, blocks)
    assert store.is_up and store.lookup(keys).num_blocks == 2  # the daemon kept them (write-through)
    store.close()
    daemon.stop()
    never = GuardedStore(ConnectorSettings(store_url=f"unix://{tmp_path}/nothing.sock"), LAYOUT, "m")
    with pytest.raises(DaemonUnreachableError, match="tenant is unknown"):  # unknown while the daemon is down
        never.block_keys([1] * 16, "")
    assert never.tenant_for("salt") is None
    assert never.lookup([b"\0" * 32]).num_blocks == 0 and never.failures >= 1
    never.close()


def test_a_daemon_that_stops_answering_stalls_lookups_once_per_outage(tmp_path: Path) -> None:
    """SIGSTOP: the daemon accepts connections and never answers. The scheduler's lookups run on
    vLLM's scheduling thread: one waits out lookup_timeout_s, then every lookup misses at once
    while the reconnection retries in the background; after SIGCONT the hits come back."""
    daemon = DaemonProc(tmp_path / "data", host_mem="2MiB", disk="2MiB")
    settings = ConnectorSettings(store_url=daemon.unix, retry_s=0.2, lookup_timeout_s=0.5)
    store = GuardedStore(settings, LAYOUT, "m", timeout_s=settings.lookup_timeout_s)  # as the connector does
    try:
        keys = store.block_keys(list(range(16)), "")
        # Set-up: the put syncs the daemon's disk (write-through), which on a busy machine can
        # outlast the 0.5 s timeout; then the store is down until its reconnection, and the
        # put is tried again.
        wait_until(lambda: store.is_up and store.try_put(keys, torch.randn(2, *LAYOUT.block_shape)), 30,
                   "the daemon taking the first put", poll_s=0.05)
        assert store.lookup(keys).num_blocks == 2
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        assert store.lookup(keys).num_blocks == 0
        assert time.monotonic() - started < 0.5 + 1.0  # the lookup timeout (and a busy machine's slack)
        worst, deadline = 0.0, time.monotonic() + 2.0  # ten reconnection periods, each attempt timing out
        while time.monotonic() < deadline:
            started = time.monotonic()
            assert store.lookup(keys).num_blocks == 0
            with pytest.raises(DaemonUnreachableError):  # at once, not after a connection attempt
                store.block_keys([1] * 16, "")
            worst = max(worst, time.monotonic() - started)
            time.sleep(0.02)  # a lookup every 20 ms through the outage: its length is the point
        assert worst < 0.1, f"a lookup waited {worst:.2f} s for a stalled daemon"
        os.kill(daemon.proc.pid, signal.SIGCONT)
        wait_until(lambda: store.is_up, 10, "the store reconnected")
        assert store.lookup(keys).num_blocks == 2
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
        store.close()
        daemon.stop()
