"""``kvstore serve --kv-events`` as a real process: a subscriber's view, rebuilt from the events
alone, equals what the daemon reports over REST after puts that evict through host RAM and
disk; a daemon restart is a new epoch whose snapshot holds the reopened disk tier."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from kvstore.events import Subscriber
from kvstore.events.wire import CPU, DISK
from tests.daemon.daemon_helpers import DaemonProc, blocks, prompt

from events_helpers import free_port_pair, until

TIER_OF = {CPU: "host", DISK: "disk"}


def daemon_truth(daemon: DaemonProc, view: dict[str, set[bytes]]) -> dict[str, int]:
    """Per medium, how many blocks the daemon's REST says it holds; and every block the view
    places in a medium is, per REST, in that tier."""
    tiers = httpx.get(f"{daemon.http}/v1/tiers").json()["tiers"]
    for medium, keys in view.items():
        for key in keys:
            info = httpx.get(f"{daemon.http}/v1/blocks/{key.hex()}")
            assert info.status_code == 200 and TIER_OF[medium] in info.json()["tiers"], (medium, key.hex())
    return {m: tiers[t]["num_blocks"] for m, t in TIER_OF.items() if tiers[t]["num_blocks"]}


def sizes(sub: Subscriber) -> dict[str, int]:
    return {m: len(keys) for m, keys in sub.sink.held().items()}


def test_daemon_tiers_as_events_and_a_restart_is_a_new_epoch(tmp_path: Path) -> None:
    port = free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    daemon = DaemonProc(tmp_path / "data", "--kv-events", endpoint, host_mem="128KiB", disk="256KiB")
    sub = None
    try:
        line = next(x for x in daemon.lines if "kv events on" in x)
        found = re.search(r"kv events on (\S+) \(replay (\S+)\)", line)
        assert found and found.group(1) == endpoint and found.group(2) == f"tcp://127.0.0.1:{port + 1}"
        sub = Subscriber(endpoint, replay_endpoint=found.group(2), heartbeat_timeout_s=10)
        until(lambda: sub.stats()["snapshots"] == 1, sub)
        client = daemon.connect()
        for salt in range(6):  # 6 chains of 5 blocks: 8 host and 16 disk slots per namespace
            keys = client.block_keys(prompt(salt, 5))
            client.put(keys, blocks(keys))
        stats = httpx.get(f"{daemon.http}/v1/tiers").json()["tiers"]
        assert stats["host"]["evictions"] > 0 and stats["disk"]["evictions"] > 0
        until(lambda: sizes(sub) == daemon_truth(daemon, sub.sink.held()), sub)
        assert set(sizes(sub)) == {CPU, DISK} and not sub.approximate
        client.close()
        first_epoch = sub.epoch
        assert daemon.stop() == 0
        daemon.start()  # same data dir and endpoint: the disk tier is reopened and announced
        until(lambda: sub.epoch != first_epoch and sub.stats()["epochs"] == 1, sub, timeout=20)
        until(lambda: sizes(sub) == daemon_truth(daemon, sub.sink.held()), sub)
        assert DISK in sizes(sub) and CPU not in sizes(sub)
        metrics = httpx.get(f"{daemon.http}/metrics").text
        assert "kvstore_kv_events_dropped_events_total 0.0" in metrics
    finally:
        if sub is not None:
            sub.close()
        if daemon.proc.poll() is None:
            daemon.kill9()
