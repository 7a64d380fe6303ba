"""``kvstore engine`` over lower tiers that outlive it: with ``--disk-path`` (the embedded
store) or ``--store-url unix://...`` (a real ``kvstore serve`` daemon), SIGTERM writes the device
cache back, and the next engine process serves the same prompt's prefix from those tiers."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from kvstore import KVLayout, StoreSettings, TieredStore
from tests.daemon.daemon_helpers import DaemonProc

from serve_helpers import BLOCK, EngineServer
from waiting import wait_until

PROMPT = [30 + i for i in range(12 * BLOCK + 1)]  # 12 full cacheable blocks


def usage(server: EngineServer) -> dict:
    r = server.client().completions.create(model="random", prompt=PROMPT, max_tokens=2, temperature=0)
    return r.usage.model_dump()


def restart_finds_the_prefix(*args: str) -> dict:
    first = EngineServer(*args)
    try:
        assert usage(first)["prompt_tokens_details"]["cached_tokens"] == 0
        info = httpx.get(f"{first.url}/v1/kvstore/info").json()
        assert first.stop() == 0  # drain: the device cache goes to the store
    finally:
        first.kill()
    second = EngineServer(*args)
    try:
        u = usage(second)
        assert httpx.get(f"{second.url}/v1/kvstore/info").json()["namespace"] == info["namespace"]
    finally:
        second.kill()
    assert u["prompt_tokens_details"]["cached_tokens"] == 12 * BLOCK
    assert u["kvstore"]["cached_tokens"]["device"] == 0
    return u["kvstore"]["cached_tokens"]


def test_embedded_disk_tier_survives_a_restart(tmp_path: Path) -> None:
    tiers = restart_finds_the_prefix("--disk-path", str(tmp_path / "kv"), "--disk-size", "16MiB")
    assert tiers["disk"] + tiers["host"] == 12 * BLOCK and tiers["disk"] > 0


def test_the_store_flags_build_the_embedded_store(tmp_path: Path) -> None:
    """``--disk-codec int8`` reaches the engine's store: the blocks its SIGTERM wrote back are on
    disk int8-coded (a store opened with the raw codec would find none: it reformats the tier)."""
    disk = tmp_path / "kv"
    server = EngineServer("--disk-path", str(disk), "--disk-size", "16MiB", "--disk-codec", "int8",
                          "--write-policy", "write_through", "--promotion", "never")
    try:
        assert usage(server)["prompt_tokens_details"]["cached_tokens"] == 0
        ns = httpx.get(f"{server.url}/v1/kvstore/info").json()["namespace"]
        assert server.stop() == 0
    finally:
        server.kill()
    layout = KVLayout(ns["num_layers"], ns["num_kv_heads"], ns["head_dim"], ns["block_size"], ns["dtype"])
    settings = StoreSettings(host_bytes=1 << 20, disk_path=disk, disk_bytes=16 << 20, disk_codec="int8")
    with TieredStore(settings.store_config(layout, ns["model_id"])) as store:
        found = store.lookup(store.block_keys(PROMPT))
        assert found.tiers == ("disk",) * 12 and found.lossy == (True,) * 12
        assert store.stats()["disk"]["codec"] == "int8"


def test_daemon_tiers_serve_a_restarted_engine(tmp_path: Path) -> None:
    daemon = DaemonProc(tmp_path / "data", host_mem="8MiB", disk="16MiB")
    try:
        tiers = restart_finds_the_prefix("--store-url", daemon.unix)
        assert tiers["host"] + tiers["disk"] == 12 * BLOCK
    finally:
        daemon.kill9()


def daemon_blocks(daemon: DaemonProc) -> int:
    return int(httpx.get(f"{daemon.http}/v1/tiers").json()["tiers"]["host"]["num_blocks"])


def test_a_running_engine_shares_its_prefix_through_the_daemon_at_once(tmp_path: Path) -> None:
    """Write-through (the default): engine B finds engine A's prefix while A keeps it on its
    device; A never stops or evicts. With --device-write-policy write_back, nothing reaches the
    daemon until A evicts, so B computes everything."""
    daemon = DaemonProc(tmp_path / "data", host_mem="8MiB", disk="16MiB")
    servers = [EngineServer("--store-url", daemon.unix), EngineServer("--store-url", daemon.unix),
               EngineServer("--store-url", daemon.unix, "--device-write-policy", "write_back")]
    first, second, lazy = servers
    try:
        assert usage(first)["prompt_tokens_details"]["cached_tokens"] == 0
        # the writes run on A's demoter thread, after the step
        wait_until(lambda: daemon_blocks(daemon) >= 12, 20, "A's 12 blocks in the daemon")
        u = usage(second)
        assert u["prompt_tokens_details"]["cached_tokens"] == 12 * BLOCK
        assert u["kvstore"]["cached_tokens"]["host"] == 12 * BLOCK

        held = daemon_blocks(daemon)
        other = {"model": "random", "prompt": [200 + i for i in range(12 * BLOCK + 1)], "max_tokens": 2,
                 "temperature": 0}
        lazy.client().completions.create(**other)  # type: ignore[call-overload]
        # an absence is what is tested: nothing to wait for but time, far past when write-through,
        # above, is done (within milliseconds of the step)
        time.sleep(1.0)
        assert daemon_blocks(daemon) == held  # write-back: still only on lazy's device
    finally:
        for s in servers:
            s.kill()
        daemon.kill9()
