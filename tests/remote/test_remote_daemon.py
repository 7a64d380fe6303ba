"""Two ``kvstore serve --remote-url`` daemons ("two nodes") share one cluster; REST, metrics and
the dashboard show the remote tier and its nodes; the password never shows anywhere."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

import kvstore
from kvstore import KVLayout
from kvstore.tools.bench.redis_local import RedisCluster, RedisServer, free_port

from remote_helpers import Daemon
from waiting import wait_until

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
TOKENS = '[[tenant]]\nname = "acme"\ntokens = ["tok-acme"]\n\n[[tenant]]\nname = "globex"\ntokens = ["tok-globex"]\n'


def payload(keys: list[bytes]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int.from_bytes(keys[0][:4], "little"))
    return torch.randn((len(keys), *LAYOUT.block_shape), generator=gen)


def connect(daemon: Daemon, token: str, shm: bool = False) -> kvstore.StoreClient:
    return kvstore.connect(daemon.unix, token=token, layout=LAYOUT, model_id="m", shm=shm)


def test_two_daemons_share_blocks_and_tenants_stay_apart(cluster: RedisCluster, tmp_path: Path) -> None:
    (tmp_path / "tokens.toml").write_text(TOKENS)
    common = ("--remote-url", cluster.url, "--remote-timeout", "3", "--tokens", str(tmp_path / "tokens.toml"))
    node_a, node_b = Daemon(tmp_path / "a", *common), Daemon(tmp_path / "b", *common)
    try:
        tokens = list(range(40))
        with connect(node_a, "tok-acme", shm=True) as a:  # a put through shared memory (commit)
            assert a.uses_shm
            keys = a.block_keys(tokens)
            a.put(keys, payload(keys))
        with connect(node_b, "tok-acme") as b:
            keys_b = b.block_keys(tokens)
            wait_until(lambda: b.lookup(keys_b).num_blocks == 10, 15, "node A's write-behind seen by B")
            assert b.lookup(keys_b).tiers == ("remote",) * 10
            assert torch.equal(b.get(keys_b), payload(keys))  # exactly what A's client put
            assert b.lookup(keys_b).tiers == ("host",) * 10  # promoted on node B
        with connect(node_b, "tok-globex") as g:  # the same prompt, another tenant: nothing
            assert g.lookup(g.block_keys(tokens)).num_blocks == 0
        tiers = json.loads(node_b.get("/v1/tiers"))
        remote = tiers["tiers"]["remote"]
        assert remote["hits"] >= 10 and remote["nodes_up"] == 3 and remote["capacity_bytes"] == 3 * cluster.maxmemory
        assert len(tiers["remote_nodes"]) == 3 and all(n["up"] for n in tiers["remote_nodes"])
        metrics = node_b.get("/metrics")
        assert re.search(r'kvstore_tier_hits_total\{namespace="[^"]+",tier="remote"\} [1-9]', metrics)
        assert len(re.findall(r"^kvstore_remote_node_used_memory\{", metrics, re.M)) == 3
        assert "kvstore_remote_node_evicted_keys_total" in metrics and "kvstore_tier_dropped_total" in metrics
        assert remote["round_trips"] >= 1  # B's first lookup and get asked the cluster
        assert re.search(r'kvstore_tier_round_trips_total\{namespace="[^"]+",tier="remote"\} [1-9]', metrics)
        for name in ("hint_hits", "hint_misses", "kept_used"):
            assert f"kvstore_tier_{name}_total{{" in metrics
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium:  # .ci/run installs it; the dashboard test in tests/daemon covers the rest
            with tempfile.TemporaryDirectory(prefix="kvr-chrome-") as profile:
                dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                      "--disable-dev-shm-usage", f"--user-data-dir={profile}",
                                      "--virtual-time-budget=3000", "--dump-dom", f"{node_b.http}/"],
                                     capture_output=True, text=True, timeout=90).stdout
            assert 'data-tier="remote"' in dom
            assert len(re.findall(r'<tr data-node="127\.0\.0\.1:\d+"', dom)) == 3
    finally:
        node_a.stop()
        node_b.stop()
    assert node_a.proc.returncode == 0 and node_b.proc.returncode == 0
    assert not any("warning" in line for line in node_a.lines + node_b.lines)  # the cluster answered


def test_a_remote_that_does_not_answer_is_named_at_start_and_the_daemon_serves(tmp_path: Path) -> None:
    secret = "pw-nobody-2b7c"
    url = f"redis://default:{secret}@127.0.0.1:{free_port(bus=False)}"  # nothing listens there
    daemon = Daemon(tmp_path / "d", "--remote-url", url, "--remote-timeout", "0.2")
    try:
        output = "".join(daemon.lines)
        assert "warning: no node of the remote tier redis://default:***@127.0.0.1:" in output
        assert "Connection refused" in output and secret not in output
        assert output.index("warning") < output.index("ready")
        with connect(daemon, "") as client:  # served from this node's tiers meanwhile
            keys = client.block_keys(list(range(16)))
            client.put(keys, payload(keys))
            assert torch.equal(client.get(keys), payload(keys))
    finally:
        daemon.stop()
    assert daemon.proc.returncode == 0


def test_the_remote_password_never_leaves_the_daemon(tmp_path: Path) -> None:
    secret = "pw-daemon-9d1f"
    server = RedisServer.start(tmp_path / "redis", password=secret)
    url = f"redis://default:{secret}@127.0.0.1:{server.node.port}"
    (tmp_path / "serve.toml").write_text(f'remote_url = "{url}"\n')
    daemon = Daemon(tmp_path / "d", "--config", str(tmp_path / "serve.toml"))
    try:
        with connect(daemon, "") as client:
            keys = client.block_keys(list(range(16)))
            client.put(keys, payload(keys))
            wait_until(lambda: json.loads(daemon.get("/v1/tiers"))["tiers"]["remote"]["bytes_written"] > 0,
                       15, "bytes written to the remote tier")
            seen = [daemon.get("/v1/tiers"), daemon.get("/v1/stats"), daemon.get("/metrics"),
                    json.dumps(client.stats())]
    finally:
        daemon.stop()
        server.close()
    seen.append("".join(daemon.lines))
    assert all(secret not in text for text in seen)


@pytest.mark.parametrize("bad", ["http://h:1", "redis://h:notaport"])
def test_a_bad_remote_url_is_a_clear_error(tmp_path: Path, bad: str) -> None:
    import sys

    proc = subprocess.run([sys.executable, "-m", "kvstore.services.daemon", "serve", "--data-dir", str(tmp_path),
                           "--remote-url", bad], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--remote-url" in proc.stderr and "remote URL" in proc.stderr
