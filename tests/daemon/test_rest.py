"""REST over a real daemon (real uvicorn, real HTTP) and over an embedded store; the
dashboard in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import KVLayout, StoreConfig, TieredStore
from kvstore.services.daemon.registry import COUNTERS
from kvstore.services.daemon.rest import create_app
from kvstore.services.daemon.rest_common import DEPRECATED_SINCE

from daemon_helpers import DaemonProc, blocks, call, prompt
from factories import require
from waiting import wait_serving, wait_until

ADMIN, ACME, GLOBEX, BETA = "tok-admin", "tok-acme", "tok-globex", "tok-beta"  # beta never sends a request


@pytest.fixture(scope="module")
def rest_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    root = tmp_path_factory.mktemp("rest")
    tokens = root / "tokens.toml"
    tokens.write_text(f'[[tenant]]\nname = "acme"\ntokens = ["{ACME}"]\n\n'
                      f'[[tenant]]\nname = "globex"\ntokens = ["{GLOBEX}"]\n\n'
                      f'[[tenant]]\nname = "beta"\ntokens = ["{BETA}"]\n')
    d = DaemonProc(root / "data", "--tokens", str(tokens), "--token", ADMIN, disk="4MiB")
    yield d
    d.stop()


def test_tiers_stats_lookup_blocks(rest_daemon: DaemonProc) -> None:
    d = rest_daemon
    tokens = prompt(31, 5)
    with d.connect(ACME) as acme:
        keys = acme.block_keys(tokens)
        acme.put(keys, blocks(keys))
        acme.lookup(keys)
    status, tiers = call(f"{d.http}/v1/tiers")
    assert status == 200
    host = tiers["tiers"]["host"]
    assert set(host) >= {"capacity_bytes", "used_bytes", "num_blocks", "hits", "misses", "evictions",
                         "bytes_read", "bytes_written", "errors"}
    assert host["num_blocks"] >= 5 and "disk" in tiers["tiers"]
    assert call(f"{d.http}/v1/stats")[0] == 401
    status, stats = call(f"{d.http}/v1/stats", token=ACME)
    assert status == 200 and set(stats["tenants"]) == {"acme"} and stats["tenants"]["acme"]["put_blocks"] >= 5
    assert 0 <= stats["hit_ratio"]["host"] <= 1 and stats["totals"]["num_blocks"] >= 5
    status, lookup = call(f"{d.http}/v1/lookup", "POST", {"model": "test-model", "token_ids": [*tokens, 1, 2]}, ACME)
    assert status == 200, lookup
    assert lookup["matched_tokens"] == {"host": 20, "disk": 0, "total": 20} and lookup["tenant"] == "acme"
    status, other = call(f"{d.http}/v1/lookup", "POST", {"model": "test-model", "token_ids": tokens}, GLOBEX)
    assert status == 200 and other["matched_tokens"]["total"] == 0
    assert call(f"{d.http}/v1/lookup", "POST", {"model": "nope", "token_ids": [1]}, ACME)[0] == 404
    assert call(f"{d.http}/v1/lookup", "POST", {"model": "test-model", "token_ids": [-1]}, ACME)[0] == 422
    status, info = call(f"{d.http}/v1/blocks/{keys[0].hex()}", token=ACME)
    assert status == 200, info
    assert info["tier"] == "host" and info["tenant"] == "acme" and info["size"] == 512 and info["pins"] == 0
    assert info["last_access"] >= info["created"] > 0
    assert call(f"{d.http}/v1/blocks/{keys[0].hex()}", token=GLOBEX)[0] == 404
    assert call(f"{d.http}/v1/blocks/xyz", token=ACME)[0] == 422
    status, spaces = call(f"{d.http}/v1/namespaces", token=ADMIN)
    assert status == 200 and spaces["namespaces"][0]["model_id"] == "test-model"
    status, tenants = call(f"{d.http}/v1/tenants", token=ADMIN)
    assert status == 200 and "acme" in tenants["tenants"]
    assert set(call(f"{d.http}/v1/tenants", token=GLOBEX)[1]["tenants"]) == {"globex"}


def test_configured_tiers_show_before_any_client(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "data", host_mem="1MiB", disk="2MiB")
    try:
        tiers = call(f"{d.http}/v1/tiers")[1]["tiers"]
        assert set(tiers) == {"host", "disk"}
        assert tiers["host"]["capacity_bytes"] == 1 << 20 and tiers["disk"]["capacity_bytes"] == 2 << 20
        for row in tiers.values():
            assert {k: v for k, v in row.items() if k != "capacity_bytes"} == {**dict.fromkeys(
                ["used_bytes", "num_blocks", "hits", "misses", "evictions", "bytes_read", "bytes_written",
                 "errors", "refused"], 0), "codec": "none", "lossy": False}
        with d.connect() as client:  # a namespace opens: the totals stay the configured ones
            keys = client.block_keys(prompt(5, 3))
            client.put(keys, blocks(keys))
        tiers = call(f"{d.http}/v1/tiers")[1]["tiers"]
        assert tiers["host"]["capacity_bytes"] == 1 << 20 and tiers["host"]["num_blocks"] == 3
        assert d.stop() == 0
    finally:
        if d.proc.poll() is None:
            d.kill9()


def test_admin_needs_the_admin_token(rest_daemon: DaemonProc) -> None:
    d = rest_daemon
    with d.connect(ACME) as acme:
        keys = acme.block_keys(prompt(32, 3))
        acme.put(keys, blocks(keys))
    body = {"keys": [k.hex() for k in keys], "tenant": "acme"}
    for path in ("flush", "pin", "evict"):
        assert call(f"{d.http}/v1/admin/{path}", "POST", body)[0] == 401
        assert call(f"{d.http}/v1/admin/{path}", "POST", body, "bogus")[0] == 401
        assert call(f"{d.http}/v1/admin/{path}", "POST", body, ACME)[0] == 403
    assert call(f"{d.http}/v1/admin/pin", "POST", body, ADMIN) == (200, {"pinned": 3})
    assert call(f"{d.http}/v1/blocks/{keys[0].hex()}", token=ACME)[1]["pins"] == 1
    assert call(f"{d.http}/v1/admin/evict", "POST", body, ADMIN)[0] == 409  # pinned
    assert call(f"{d.http}/v1/admin/pin", "POST", {**body, "unpin": True}, ADMIN) == (200, {"unpinned": 3})
    assert call(f"{d.http}/v1/admin/evict", "POST", body, ADMIN) == (200, {"evicted": 3})
    status, flushed = call(f"{d.http}/v1/admin/flush", "POST", {"tenant": "acme"}, ADMIN)
    assert status == 200 and flushed["deleted"] >= 0
    with d.connect(ACME) as acme:
        assert acme.lookup(keys).num_blocks == 0


def answer(url: str, body: Any, token: str | None = None) -> tuple[int, Any, Any]:
    """A REST POST: its status, its JSON body and its headers, errors included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    if token:
        req.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers


def test_admin_pin_and_evict_are_deprecated_aliases(tmp_path: Path) -> None:
    """/v1/admin/pin and /v1/admin/evict answer as they did, and say they are deprecated: every
    answer carries Deprecation and a Link to the successor, the schema marks them, and the
    daemon logs one warning per route per process naming the route to use instead."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[[tenant]]\nname = "acme"\ntokens = ["{ACME}"]\n')
    d = DaemonProc(tmp_path / "data", "--tokens", str(tokens), "--token", ADMIN)
    try:
        with d.connect(ACME) as acme:
            keys = acme.block_keys(prompt(50, 2))
            acme.put(keys, blocks(keys))
        body = {"keys": [k.hex() for k in keys], "tenant": "acme"}
        successors = {"pin": "/v1/cache/pin", "evict": "/v1/cache/delete"}
        for route, successor in successors.items():
            status, _, headers = answer(f"{d.http}/v1/admin/{route}", body)
            assert status == 401  # errors are marked too
            assert headers["Deprecation"] == DEPRECATED_SINCE and headers["Link"] == f'<{successor}>; rel="successor-version"'
        status, pinned, headers = answer(f"{d.http}/v1/admin/pin", body, ADMIN)
        assert (status, pinned) == (200, {"pinned": 2}) and headers["Deprecation"] == DEPRECATED_SINCE
        assert answer(f"{d.http}/v1/admin/pin", {**body, "unpin": True}, ADMIN)[:2] == (200, {"unpinned": 2})
        status, evicted, headers = answer(f"{d.http}/v1/admin/evict", body, ADMIN)
        assert (status, evicted) == (200, {"evicted": 2})
        assert headers["Link"] == '</v1/cache/delete>; rel="successor-version"'
        status, _, headers = answer(f"{d.http}/v1/cache/delete", {"model": "test-model", "keys": body["keys"]}, ACME)
        assert status == 200 and "Deprecation" not in headers  # the successor is not deprecated
        paths = call(f"{d.http}/openapi.json")[1]["paths"]
        assert paths["/v1/admin/pin"]["post"]["deprecated"] is True
        assert paths["/v1/admin/evict"]["post"]["deprecated"] is True
        assert "deprecated" not in paths["/v1/cache/pin"]["post"] and "deprecated" not in paths["/v1/admin/flush"]["post"]
        assert d.stop() == 0
        # the daemon's last line: all its output was read
        wait_until(lambda: "kvstore serve: stopped" in d.output, 10, "the daemon's last line read")
        assert "kvstore serve: stopped" in d.output
        for route, successor in successors.items():
            warning = f"POST /v1/admin/{route} is deprecated: use POST {successor} instead"
            assert d.output.count(warning) == 1, d.output  # once per process, though used 3 and 2 times
    finally:
        if d.proc.poll() is None:
            d.kill9()


def test_metrics_health_openapi(rest_daemon: DaemonProc) -> None:
    d = rest_daemon
    status, text = call(f"{d.http}/metrics")
    assert status == 200
    assert re.search(r'kvstore_tier_capacity_bytes\{namespace="\w+",tier="host"\} \S+', text)
    assert "kvstore_tier_hits_total" in text and "kvstore_daemon_requests_total" in text
    assert call(f"{d.http}/healthz")[1]["status"] == "ok"
    status, spec = call(f"{d.http}/openapi.json")
    assert status == 200 and "/v1/lookup" in spec["paths"] and "/v1/admin/flush" in spec["paths"]


def test_metrics_show_tenant_series_only_to_a_token_that_may_see_them(rest_daemon: DaemonProc) -> None:
    d = rest_daemon
    for token in (ACME, GLOBEX):
        with d.connect(token) as client:
            client.lookup(client.block_keys(prompt(40, 1)))
    series = re.compile(r'^kvstore_tenant_requests_total\{tenant="(\w*)"\}', re.M)
    status, public = call(f"{d.http}/metrics")
    assert status == 200 and series.findall(public) == []
    assert "acme" not in public and "globex" not in public
    assert 'kvstore_tier_used_bytes{namespace="' in public and "kvstore_daemon_requests_total" in public
    assert {"acme", "globex"} <= set(series.findall(call(f"{d.http}/metrics", token=ADMIN)[1]))
    assert set(series.findall(call(f"{d.http}/metrics", token=ACME)[1])) == {"acme"}
    assert series.findall(call(f"{d.http}/metrics", token=BETA)[1]) == []  # beta has no traffic
    assert call(f"{d.http}/metrics", token="bogus")[0] == 401


def test_a_tenant_with_no_traffic_gets_zeroed_counters(rest_daemon: DaemonProc) -> None:
    d = rest_daemon
    with d.connect(ACME) as acme:  # a namespace is open, with another tenant's traffic in it
        acme.lookup(acme.block_keys(prompt(41, 1)))
    zeros = dict.fromkeys(COUNTERS, 0)
    status, seen = call(f"{d.http}/v1/tenants", token=BETA)
    assert status == 200 and seen["tenants"] == {"beta": zeros} and set(seen["usage"]) == {"beta"}
    status, stats = call(f"{d.http}/v1/stats", token=BETA)
    assert status == 200 and stats["tenants"] == {"beta": zeros}
    assert stats["namespaces"] and all(ns["counters"] == zeros for ns in stats["namespaces"].values())
    assert "beta" not in call(f"{d.http}/v1/tenants", token=ADMIN)[1]["tenants"]


def serve_app(app: Any) -> tuple[str, Any, threading.Thread]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_serving(server, thread)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def test_embedded_store_gets_the_same_api(tmp_path: Path) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
    store = TieredStore(StoreConfig(layout=layout, model_id="emb", host_bytes=16 * 4096))
    keys = store.block_keys(prompt(1, 3), tenant="t1")
    store.put(keys, blocks(keys), tenant="t1")
    url, server, thread = serve_app(create_app(store, admin_token="adm"))
    try:
        assert call(f"{url}/v1/tiers")[1]["tiers"]["host"]["num_blocks"] == 3
        assert call(f"{url}/v1/blocks/{keys[1].hex()}")[0] == 401  # a token is configured: reads need one
        status, info = call(f"{url}/v1/blocks/{keys[1].hex()}", token="adm")
        assert status == 200 and info["tenant"] == "t1"
        status, m = call(f"{url}/v1/lookup", "POST", {"model": "emb", "token_ids": prompt(1, 3)}, "adm")
        assert status == 200 and m["matched_tokens"]["total"] == 0  # the admin is tenant "", not t1
        assert call(f"{url}/v1/admin/evict", "POST", {"keys": [keys[2].hex()]})[0] == 401
        assert call(f"{url}/v1/admin/evict", "POST", {"keys": [keys[2].hex()]}, "adm") == (200, {"evicted": 1})
        assert "<html" in call(url)[1]
    finally:
        server.should_exit = True
        thread.join(10)
        store.close()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_dashboard_renders_live_tiers_in_chromium(rest_daemon: DaemonProc) -> None:
    require(CHROMIUM, "Debian's chromium is not installed (.ci/run installs it)")
    d = rest_daemon
    with d.connect(ACME) as acme:
        keys = acme.block_keys(prompt(33, 7))
        acme.put(keys, blocks(keys))
    expected = call(f"{d.http}/v1/tiers")[1]["tiers"]
    with tempfile.TemporaryDirectory(prefix="kvd-chrome-") as profile:
        proc = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=4000",
             "--dump-dom", f"{d.http}/"],
            capture_output=True, text=True, timeout=90,
        )
    dom = proc.stdout
    assert 'data-tier="host"' in dom, (proc.returncode, proc.stderr[-2000:], dom[:2000])
    assert 'data-tier="disk"' in dom
    for tier in ("host", "disk"):
        card = re.search(rf'<section class="tier" data-tier="{tier}"[^>]*>', dom)
        assert card, dom[:3000]
        attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', card.group(0)))
        assert int(attrs["capacity-bytes"]) == expected[tier]["capacity_bytes"]
        # blocks are stable; used bytes are not: a shared-memory client's standing write lease
        # holds reserved host slots until its connection's leases are dropped
        assert int(attrs["num-blocks"]) == expected[tier]["num_blocks"] > 0
        assert int(attrs["used-bytes"]) >= expected[tier]["num_blocks"] * 4096
    refreshes = re.search(r'id="status"[^>]*data-refreshes="(\d+)"', dom) or re.search(
        r'data-refreshes="(\d+)"[^>]*id="status"', dom)
    assert refreshes and int(refreshes.group(1)) >= 2, "the page does not refresh itself"
    assert "<polyline" in dom
