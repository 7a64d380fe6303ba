"""Quotas and usage per tenant through a real daemon: tokens file quotas, concurrent puts from
several tenants' connections under a hard quota, quota changes at run time over REST (admin
only, bad input refused with nothing changed), per-tenant metrics with bounded labels, the
dashboard's tenants table in headless Chromium."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_rest import CHROMIUM

from daemon_helpers import ROOT, DaemonProc, blocks, call, prompt
from factories import require, run_in_threads

ADMIN = "tok-admin"
TENANTS = {"acme": "tok-acme", "globex": "tok-globex", "flood": "tok-flood"}
SLOTS = 64  # host RAM: 64 slots of 4 KiB (512-byte blocks of the test layout)


def tokens_file(path: Path, tenants: dict[str, str], extra: dict[str, str] | None = None) -> Path:
    path.write_text("".join(f'[[tenant]]\nname = "{name}"\ntokens = ["{tok}"]\n{(extra or {}).get(name, "")}\n'
                            for name, tok in tenants.items()))
    return path


@pytest.fixture(scope="module")
def quota_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    root = tmp_path_factory.mktemp("quotas")
    tokens = tokens_file(root / "tokens.toml", TENANTS,
                         {"flood": 'quota = { host = { soft = "25%", hard = "25%" } }'})
    d = DaemonProc(root / "data", "--tokens", str(tokens), "--token", ADMIN, "--max-namespaces", "1",
                   host_mem=f"{SLOTS * 4}KiB", disk="1MiB")
    yield d
    if d.proc.poll() is None:
        d.kill9()


def usage(d: DaemonProc) -> dict[str, Any]:
    status, body = call(f"{d.http}/v1/tenants", token=ADMIN)
    assert status == 200, body
    return body["usage"]  # type: ignore[no-any-return]


def test_tokens_file_quotas_hold_under_concurrent_puts_of_several_tenants(quota_daemon: DaemonProc) -> None:
    d = quota_daemon
    quotas = call(f"{d.http}/v1/quotas", token=ADMIN)[1]["quotas"]
    # the file's host quota over the default (an equal soft share of every tier)
    assert quotas["flood"] == {"*": {"soft": "33.3333%"}, "host": {"soft": "25%", "hard": "25%"}}
    assert quotas["acme"] == {"*": {"soft": "33.3333%"}}  # the default: equal soft shares
    cap = SLOTS // 4
    done = threading.Event()
    worst = {"flood": 0}

    def watch() -> None:  # the daemon's own usage, over REST, while the puts run
        while not done.is_set():
            row = usage(d).get("flood", {}).get("tiers", {}).get("host", {})
            worst["flood"] = max(worst["flood"], row.get("blocks", 0))

    watcher = threading.Thread(target=watch)
    watcher.start()

    def worker(i: int) -> None:
        name = ("flood", "flood", "acme", "globex")[i]
        with d.connect(TENANTS[name]) as client:  # each thread its own connection and token
            for n in range(30):
                keys = client.block_keys(prompt(100 * i + n, 1 + (n % 5)))
                client.put(keys, blocks(keys))  # a refusal at the quota is no error

    try:
        run_in_threads(worker, 4)
    finally:
        done.set()
        watcher.join(30)
    final = usage(d)
    assert worst["flood"] <= cap and final["flood"]["tiers"]["host"]["blocks"] <= cap
    assert final["flood"]["tiers"]["host"]["hard_blocks"] == cap
    tiers = call(f"{d.http}/v1/tiers")[1]["tiers"]
    assert sum(u["tiers"]["host"]["blocks"] for u in final.values()) == tiers["host"]["num_blocks"]
    assert final["flood"]["tiers"]["host"]["evictions_suffered"] > 0  # over its share: evicted first
    mine = call(f"{d.http}/v1/tenants", token=TENANTS["acme"])[1]
    assert set(mine["usage"]) == set(mine["tenants"]) == set(mine["quotas"]) == {"acme"}


def test_quota_changes_at_run_time_need_the_admin_and_bad_input_changes_nothing(quota_daemon: DaemonProc) -> None:
    d = quota_daemon
    url = f"{d.http}/v1/admin/quotas/acme"
    body = {"tiers": {"host": {"soft": "20%", "hard": 8 * 4096}}}
    assert call(url, "PUT", body)[0] == 401
    assert call(url, "PUT", body, "bogus")[0] == 401
    assert call(url, "PUT", body, TENANTS["acme"])[0] == 403
    before = call(f"{d.http}/v1/quotas", token=ADMIN)[1]
    for bad, status, message in (
        ({"tiers": {"host": {"soft": -1}}}, 422, "integer >= 0, got -1"),
        ({"tiers": {"host": {"soft": 1.5}}}, 422, "share must be in (0, 1]"),
        ({"tiers": {"host": {"soft": "0%"}}}, 422, "share must be in (0, 1]"),
        ({"tiers": {"ssd": {"soft": "10%"}}}, 422, "no tier 'ssd'"),
        ({"tiers": {"disk": {"hard": "10%"}}}, 422, "a hard quota applies to ['host']"),
        ({"tiers": {"host": {"soft": "1GB?"}}}, 422, "not a number with an optional unit"),
        ({"tiers": {"host": {"softly": 1}}}, 422, ""),
    ):
        status_got, reply = call(url, "PUT", bad, ADMIN)
        assert status_got == status and message in str(reply), (bad, reply)
    assert call(f"{d.http}/v1/admin/quotas/nobody", "PUT", body, ADMIN)[0] == 404
    assert call(f"{d.http}/v1/quotas", token=ADMIN)[1] == before  # nothing changed
    status, reply = call(url, "PUT", body, ADMIN)
    assert status == 200 and reply["quotas"]["host"] == {"soft": "20%", "hard": 8 * 4096}
    assert reply["quotas"]["*"] == {"soft": "33.3333%"}  # the other tiers keep the default
    with d.connect(TENANTS["acme"]) as acme:  # no restart: the next puts obey it
        for n in range(6):
            keys = acme.block_keys(prompt(9000 + n, 3))
            acme.put(keys, blocks(keys))
    row = usage(d)["acme"]["tiers"]["host"]
    assert row["blocks"] <= 8 and row["hard_blocks"] == 8
    assert call(f"{d.http}/v1/quotas", token=TENANTS["acme"])[1] == {"quotas": {"acme": reply["quotas"]}}
    status, reply = call(url, "PUT", {"tiers": {"host": None}}, ADMIN)  # drop the entry: "*" applies again
    assert status == 200 and reply["quotas"] == {"*": {"soft": "33.3333%"}}


def test_tenant_metrics_have_bounded_labels(tmp_path: Path) -> None:
    many = {f"t{i:02d}": f"tok-{i:02d}" for i in range(23)}
    d = DaemonProc(tmp_path / "data", "--tokens", str(tokens_file(tmp_path / "tokens.toml", many)),
                   "--token", ADMIN, "--max-namespaces", "1", disk="0")
    try:
        for i, tok in enumerate(many.values()):
            with d.connect(tok) as client:
                keys = client.block_keys(prompt(i, 1 + i % 3))
                client.put(keys, blocks(keys))
        text = call(f"{d.http}/metrics", token=ADMIN)[1]
        labels = set(re.findall(r'^kvstore_tenant_blocks\{tenant="([^"]*)",tier="host"\}', text, re.M))
        assert len(labels) == 21 and "(other)" in labels  # the top 20 and the rest summed
        held = {int(v) for v in re.findall(r'^kvstore_tenant_blocks\{tenant="t\d+",tier="host"\} (\d+)', text, re.M)}
        other = float(re.search(r'^kvstore_tenant_blocks\{tenant="\(other\)",tier="host"\} (\S+)', text, re.M).group(1))  # type: ignore[union-attr]
        assert other <= min(held) * 3  # the smallest three, summed
        own = call(f"{d.http}/metrics", token="tok-05")[1]
        assert set(re.findall(r'^kvstore_tenant_blocks\{tenant="([^"]*)"', own, re.M)) == {"t05"}
        assert "kvstore_tenant_blocks{" not in call(f"{d.http}/metrics")[1]
    finally:
        d.stop()


def test_bad_quota_configuration_refuses_to_start(tmp_path: Path) -> None:
    bad = tokens_file(tmp_path / "bad.toml", {"acme": "tok-acme"}, {"acme": 'quota = { host = { soft = "150%" } }'})
    config = tmp_path / "serve.toml"
    config.write_text('[quotas.nobody]\nhost = { soft = "10%" }\n')
    good = tokens_file(tmp_path / "good.toml", {"acme": "tok-acme"})
    for args, message in (([f"--tokens={bad}"], "quota.acme.host: a quota share must be in (0, 1]"),
                          ([f"--tokens={good}", f"--config={config}"], "quotas for unknown tenants ['nobody']")):
        proc = subprocess.run([sys.executable, "-m", "kvstore.services.daemon", "serve", "--data-dir",
                               str(tmp_path / "d"), "--socket", f"{tempfile.mkdtemp(dir='/tmp')}/s", "--listen", "",
                               "--http", "", "--host-mem", "1MiB", "--disk-size", "0", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_dashboard_shows_the_tenants_table(quota_daemon: DaemonProc) -> None:
    require(CHROMIUM, "Debian's chromium is not installed (.ci/run installs it)")
    d = quota_daemon
    expected = usage(d)
    with tempfile.TemporaryDirectory(prefix="kvd-chrome-") as profile:
        proc = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=3000",
             "--dump-dom", f"{d.http}/#token={ADMIN}"], capture_output=True, text=True, timeout=90)
    dom = proc.stdout
    rows = dict(re.findall(r'<tr data-tenant="(\w+)"[^>]*data-host-blocks="(\d+)"', dom))
    assert set(rows) >= {"acme", "globex", "flood"}, dom[-3000:]
    for tenant in ("acme", "globex", "flood"):
        assert int(rows[tenant]) == expected[tenant]["tiers"]["host"]["blocks"]
    with tempfile.TemporaryDirectory(prefix="kvd-chrome-") as profile:
        proc = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=2000",
             "--dump-dom", f"{d.http}/"], capture_output=True, text=True, timeout=90)
    assert "open this page as /#token=TOKEN" in proc.stdout and "data-tenant=" not in proc.stdout
