"""The store-only chat demo (``kvstore demo --store-only``): a multi-turn chat workload through an
embedded TieredStore, with stand-in KV instead of a model.

Several users share a system prompt; each turn's prompt is the whole conversation so far. The
host tier is deliberately small, so conversations that come back find their prefix demoted to
disk; a restart halfway shows the disk tier surviving the process. Every block read back is
checked against the bytes that were put.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import shutil
from pathlib import Path

import torch

from kvstore.config import StoreConfig
from kvstore.layout import KVLayout
from kvstore.store import TieredStore

DEMO_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float16)


def fake_kv(keys: list[bytes]) -> torch.Tensor:
    """Stand-in for prefill: KV blocks derived from their keys, so reads can be verified."""
    out = torch.empty((len(keys), *DEMO_LAYOUT.block_shape), dtype=DEMO_LAYOUT.dtype)
    for i, key in enumerate(keys):
        gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:7], "little"))
        out[i] = torch.randn(DEMO_LAYOUT.block_shape, generator=gen).to(DEMO_LAYOUT.dtype)
    return out


def open_store(args: argparse.Namespace) -> TieredStore:
    slot = DEMO_LAYOUT.bytes_per_block
    return TieredStore(StoreConfig(layout=DEMO_LAYOUT, model_id="demo-chat", host_bytes=args.host_blocks * slot,
                                   disk_path=Path(args.data_dir) / "demo", disk_bytes=args.disk_blocks * slot))


def run_turn(store: TieredStore, tokens: list[int], tenant: str) -> tuple[int, int, int]:
    keys = store.block_keys(tokens, tenant=tenant)
    match = store.lookup(keys)
    cached = keys[: match.num_blocks]
    if cached:
        got = store.get(cached)
        if not torch.equal(got, fake_kv(cached)):
            raise AssertionError("the store returned KV bytes other than those put")
    missing = keys[match.num_blocks :]
    if missing:
        store.put(missing, fake_kv(missing), tenant=tenant)
    return match.count("host"), match.count("disk"), len(missing)


def print_tiers(store: TieredStore) -> None:
    for name, s in store.stats().items():
        used = s["used_bytes"] / max(1, s["capacity_bytes"])
        bar = "#" * round(30 * used) + "." * (30 - round(30 * used))
        print(f"  {name:<5} [{bar}] {s['num_blocks']:>5} blocks  hits {s['hits']:>5}  misses {s['misses']:>4}  "
              f"evictions {s['evictions']:>5}  read {s['bytes_read'] >> 20} MiB  written {s['bytes_written'] >> 20} MiB")


def run(args: argparse.Namespace) -> int:
    """The workload: ``args.users`` conversations of ``args.turns`` turns, a restart halfway."""
    rng = random.Random(args.seed)
    data_dir = Path(args.data_dir)
    if args.fresh and (data_dir / "demo").exists():
        shutil.rmtree(data_dir / "demo")
    data_dir.mkdir(parents=True, exist_ok=True)
    system_prompt = [rng.randrange(32_000) for _ in range(96)]
    histories = {f"user{u}": list(system_prompt) for u in range(args.users)}
    store = open_store(args)
    print(f"kvstore demo: {args.users} users, {args.turns} turns each; host {args.host_blocks} blocks, "
          f"disk {args.disk_blocks} blocks at {data_dir / 'demo'}; block = 16 tokens, "
          f"{DEMO_LAYOUT.bytes_per_block // 1024} KiB")
    print(f"{'turn':>4}  {'user':<6} {'prompt':>6}  {'host':>5} {'disk':>5} {'computed':>8}   (blocks)")
    totals = [0, 0, 0]
    for turn in range(args.turns):
        if turn == args.turns // 2:
            store.close()
            print("-- restart: the store closes (host RAM written back) and reopens from its disk catalog --")
            store = open_store(args)
        for user, history in histories.items():
            history.extend(rng.randrange(32_000) for _ in range(rng.randrange(20, 120)))
            host, disk, computed = run_turn(store, history, tenant="demo")
            totals = [totals[0] + host, totals[1] + disk, totals[2] + computed]
            print(f"{turn:>4}  {user:<6} {len(history) // 16:>6}  {host:>5} {disk:>5} {computed:>8}")
            history.extend(rng.randrange(32_000) for _ in range(rng.randrange(20, 80)))  # the reply
    print(f"blocks served from host {totals[0]}, from disk {totals[1]}, computed {totals[2]}")
    print("tier occupancy:")
    print_tiers(store)
    store.check_integrity()
    store.close()
    return 0
