"""Crashes and load: kill -9 during a put storm, then 32 clients for 30 s of mixed ops."""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
import urllib.request
from pathlib import Path

import torch

from kvstore import CapacityError

from daemon_helpers import LAYOUT, DaemonProc, blocks, prompt

CYCLES = 4
PER_WORKER = 150  # puts of 4 blocks per writer and cycle: all cycles fit the disk share


def test_kill9_during_put_storm_loses_only_unacknowledged(tmp_path: Path) -> None:
    # 80 MiB of disk over 4 namespace slots: 5,120 slots, more than all cycles together put.
    d = DaemonProc(tmp_path / "data", host_mem="1MiB", disk="80MiB")
    acked: list[bytes] = []
    tried: list[bytes] = []
    rng = random.Random(5)
    try:
        for cycle in range(CYCLES):
            stop = threading.Event()

            def storm(worker: int, cycle: int = cycle, stop: threading.Event = stop) -> None:
                # A socket put is acknowledged when it returns. A shared-memory put returns
                # once its commit is sent, and the commit's reply is read by the next
                # request: the previous put is acknowledged when this one returns, the last
                # one when flush() does.
                shm = worker == 0
                sent: list[bytes] = []
                try:
                    c = d.connect(shm=shm)
                    for i in range(PER_WORKER):
                        if stop.is_set():
                            break
                        keys = c.block_keys(prompt(cycle * 100_000 + worker * 10_000 + i, 4))
                        tried.extend(keys)
                        c.put(keys, blocks(keys))
                        acked.extend(sent)
                        sent = keys
                        if not shm:
                            acked.extend(sent)
                            sent = []
                    c.flush()
                    acked.extend(sent)
                except (OSError, ConnectionError, Exception):
                    return  # the daemon died mid-request

            threads = [threading.Thread(target=storm, args=(w,)) for w in range(2)]
            for t in threads:
                t.start()
            time.sleep(rng.uniform(0.4, 1.2))  # a random moment of the storm to kill the daemon at
            d.kill9()
            stop.set()
            for t in threads:
                t.join(10)
            d.start()
            with d.connect() as c:
                assert len(acked) < 5_120, "the test must fit the disk share"
                found = c.lookup(acked)
                assert found.num_blocks == len(acked), f"cycle {cycle}: acknowledged block #{found.num_blocks} lost"
                unacked = [k for k in tried if k not in set(acked)]
                for start in range(0, len(acked), 512):
                    chunk = acked[start : start + 512]
                    assert torch.equal(c.get(chunk), blocks(chunk)), f"cycle {cycle}: wrong bytes"
                if unacked:  # whatever an unacknowledged put left behind is exact or absent
                    out = torch.empty((len(unacked), *LAYOUT.block_shape))
                    present = [k for k, ok in zip(unacked, c.contains(unacked), strict=True) if ok]
                    if present:
                        got = c.get(present, out=out[: len(present)])
                        assert torch.equal(got, blocks(present))
        assert len(acked) > 0
    finally:
        d.stop()


def test_32_clients_30_seconds_mixed_ops(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "data", host_mem="2MiB", disk="8MiB")  # 128 host + 512 disk slots
    errors: list[str] = []
    over: list[str] = []
    ops = [0]
    stop = threading.Event()
    chains = [prompt(10_000 + i, 6) for i in range(300)]

    def client(n: int) -> None:
        rng = random.Random(n)
        url = d.tcp if n % 4 == 0 else d.unix
        try:
            c = d.connect(url=url, shm=n % 4 == 1)
        except Exception as exc:
            errors.append(f"connect {n}: {exc!r}")
            return
        with c:
            keyss = [c.block_keys(t) for t in chains]
            while not stop.is_set():
                keys = keyss[rng.randrange(len(keyss))]
                op = rng.random()
                try:
                    if op < 0.35:
                        c.put(keys, blocks(keys))
                    elif op < 0.7:
                        into = torch.empty((len(keys), *LAYOUT.block_shape))
                        n_got = c.fetch(keys, into=into).result(30).num_blocks
                        if not torch.equal(into[:n_got], blocks(keys[:n_got])):
                            errors.append("wrong bytes")
                    elif op < 0.85:
                        c.lookup(keys)
                    elif op < 0.9:
                        c.contains(keys)
                    elif op < 0.95:
                        if c.lookup(keys[:1]).num_blocks:
                            try:
                                c.pin(keys[:1])
                                c.unpin(keys[:1])
                            except KeyError:
                                pass  # evicted between lookup and pin
                    else:
                        with contextlib.suppress(CapacityError):  # busy elsewhere: TieredStore semantics
                            c.delete(keys[-2:])
                    ops[0] += 1
                except Exception as exc:
                    errors.append(f"client {n}: {exc!r}")

    def watch() -> None:
        while not stop.is_set():
            try:
                with urllib.request.urlopen(f"{d.http}/v1/tiers", timeout=10) as r:
                    for tier, s in json.load(r)["tiers"].items():
                        if s["used_bytes"] > s["capacity_bytes"]:
                            over.append(f"{tier}: {s['used_bytes']} > {s['capacity_bytes']}")
            except OSError as exc:
                errors.append(f"REST at {time.monotonic() - t0:.1f} s: {exc!r}")
            stop.wait(0.2)  # a sample every 0.2 s until the load stops

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(n,)) for n in range(32)] + [threading.Thread(target=watch)]
    try:
        for t in threads:
            t.start()
        time.sleep(30)  # the load's length: what this test measures holds for all of it
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, (errors[:5], d.output[-3000:])
        assert not over, over[:5]
        assert ops[0] > 500
        with urllib.request.urlopen(f"{d.http}/v1/stats", timeout=10) as r:
            stats = json.load(r)
        # NOT_FOUND / CAPACITY are the answers a racing pin or delete expects; nothing else
        unexpected = {k: v for k, v in stats["daemon"]["errors"].items() if k not in ("NOT_FOUND", "CAPACITY")}
        assert unexpected == {}, unexpected
        print(f"soak: {ops[0]} ops by 32 clients in 30 s")
    finally:
        assert d.stop() == 0
