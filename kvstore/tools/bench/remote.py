"""``kvstore bench remote``: the remote tier against redis-py on the same local Redis Cluster.

One run starts a real cluster (6 ``redis-server`` processes on loopback: 3 primaries, 3
replicas, no persistence) and measures, in batches of 64 blocks of 192 KiB:

- the remote tier as users call it, through a store (remote_store.py): a warm store's fetch,
  get and lookup + fetch, a fresh store's first fetch, a warm miss, and what decided a
  lookup's command;
- the tier alone: get and put vs redis-py's own cluster pipeline (``RedisCluster.pipeline()``)
  doing GET/SET of the same bytes on the same cluster (its GET alone, the raw baseline, and
  followed by one ``copy_`` of each value into the caller's tensor; its SET sends ready-made
  bytes: no framing, no checksum, no existence check);
- the hash-tag run length sweep (G blocks of a chain per slot) that picks the default G;
- through the engine (as ``kvstore bench engine`` does, same model): TTFT of a 2,048-token
  prompt whose prefix only the remote tier holds (a fresh engine, local tiers empty) vs full
  recompute, with its lookup and fetch stages and the round trips they made.

Rounds interleave ours and the baseline (best of N each), so a noisy neighbour slows both.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvstore.engine.checkpoint import CheckpointError
from kvstore.services.common.argtypes import positive
from kvstore.tiers.remote import RemoteTier, group_tags
from kvstore.tools.bench.harness import BENCH_LAYOUT, Row, machine, render
from kvstore.tools.bench.models import BenchModel, add_model_arguments
from kvstore.tools.bench.output import add_output_arguments, publish
from kvstore.tools.bench.redis_local import MIB, RedisCluster, need_binaries
from kvstore.tools.bench.remote_store import Baseline, bench_store, interleave, paired_ratio, render_store

NUM_BLOCKS = 64
RUN_LENGTHS = (1, 4, 16, 64)


class Chains:
    """Fresh 64-block chains from the store's own hasher (puts must write new blocks)."""

    def __init__(self, model_id: str) -> None:
        from kvstore.keys import BlockHasher, Namespace

        self.hasher = BlockHasher(Namespace(model_id, BENCH_LAYOUT, "sha256"))
        self.count = 0

    def next(self) -> list[bytes]:
        self.count += 1
        base = self.count * 10**6
        return self.hasher.block_keys(list(range(base, base + NUM_BLOCKS * BENCH_LAYOUT.block_size)))


def bench_throughput(url: str, seeds: list[int], repeat: int) -> tuple[list[Row], dict[str, Any]]:
    layout, n = BENCH_LAYOUT, NUM_BLOCKS
    payload = layout.bytes_per_block
    blocks = torch.randn((n, *layout.block_shape)).to(layout.dtype)
    rows_in = blocks.view(torch.uint8).reshape(n, payload)
    out = torch.empty_like(rows_in)
    chains = Chains(f"bench-remote-{time.time()}")
    tier = RemoteTier(url, payload, layout.fingerprint(), timeout_s=5.0)
    baseline = Baseline(seeds, rows_in, f"tier-{time.time()}")
    base = baseline.client
    values = [bytes(rows_in[i].numpy()) for i in range(n)]  # redis-py needs bytes objects
    held = chains.next()
    tier.put(held, list(rows_in))
    put_round = [0]

    def ours_get() -> None:
        ok = tier.get(held, list(out))
        assert all(ok), "remote get missed a block it holds"

    def base_get() -> None:
        baseline.get(out)

    def raw_get() -> None:
        baseline.get_raw()

    def ours_put() -> None:
        assert tier.put(chains.next(), list(rows_in)) == n

    def base_put() -> None:
        put_round[0] += 1
        pipe = base.pipeline()
        for i, value in enumerate(values):
            pipe.set(f"base-put:{put_round[0]}:{i}", value)
        pipe.execute()

    get_s, base_get_s, raw_get_s, put_s, base_put_s = interleave([ours_get, base_get, raw_get, ours_put, base_put],
                                                                 repeat)
    tier.get(held, list(out))
    assert torch.equal(out, rows_in), "remote get returned other bytes"
    size = f"{n} x {payload // 1024} KiB"
    rows = [
        Row(f"remote get (the tier alone), {size}, against the raw GET", min(get_s), min(raw_get_s),
            "redis-py cluster pipeline GET, no copy", ">= 0.9x"),
        Row(f"remote get (the tier alone), {size}", min(get_s), min(base_get_s),
            "redis-py cluster pipeline GET + copy_", ">= 0.9x"),
        Row(f"remote put, {size}", min(put_s), min(base_put_s), "redis-py cluster pipeline SET", ">= 0.9x"),
    ]
    spread = {name: (sorted(t)[len(t) // 2] / min(t) - 1) * 100
              for name, t in (("get", get_s), ("base_get", base_get_s), ("raw_get", raw_get_s), ("put", put_s),
                              ("base_put", base_put_s))}
    spread["paired_get"] = paired_ratio(base_get_s, get_s)
    spread["paired_raw_get"] = paired_ratio(raw_get_s, get_s)
    spread["paired_put"] = paired_ratio(base_put_s, put_s)
    spread["read_gbps"] = n * payload / min(get_s) / 1e9
    tier.close()
    baseline.close()
    return rows, spread


def bench_run_lengths(url: str, repeat: int) -> list[dict[str, Any]]:
    """Get and put of 64-block chains for each G: G=1 spreads a batch over every primary."""
    from redis.crc import key_slot

    layout, n = BENCH_LAYOUT, NUM_BLOCKS
    payload = layout.bytes_per_block
    rows_in = torch.randn((n, *layout.block_shape)).to(layout.dtype).view(torch.uint8).reshape(n, payload)
    out = torch.empty_like(rows_in)
    chains = Chains(f"bench-remote-sweep-{time.time()}")
    tiers = {g: RemoteTier(url, payload, layout.fingerprint(), run_length=g, timeout_s=5.0) for g in RUN_LENGTHS}
    held = {g: chains.next() for g in RUN_LENGTHS}
    for g, t in tiers.items():
        t.put(held[g], list(rows_in), group_tags(held[g], g))
    fns: list[Callable[[], object]] = []
    for g, t in tiers.items():
        def get(t: RemoteTier = t, g: int = g) -> None:
            t.get(held[g], list(out), group_tags(held[g], g))

        fns.append(get)

        def put(t: RemoteTier = t, g: int = g) -> None:
            ks = chains.next()
            t.put(ks, list(rows_in), group_tags(ks, g))

        fns.append(put)
    times = interleave(fns, repeat)
    found = []
    for j, (g, t) in enumerate(tiers.items()):
        names = t.names(held[g], group_tags(held[g], g))
        nodes = {t.owner(name) for name in names}
        found.append({"G": g, "get_s": min(times[2 * j]), "put_s": min(times[2 * j + 1]),
                      "slots": len({key_slot(name) for name in names}), "nodes": len(nodes)})
        t.close()
    return found


def bench_ttft(url: str, model: BenchModel, prompt_tokens: int, repeat: int) -> tuple[Row, dict[str, Any]]:
    """TTFT with the prefix only in the remote tier (a fresh engine each run) vs recompute."""
    from kvstore.tools.bench.engine import engine, random_prompt, ttft

    args = argparse.Namespace(device="cpu", prompt_tokens=prompt_tokens, decode_prompt=128, decode_tokens=32,
                              bench_model=model)
    prompt = random_prompt(args, prompt_tokens, 7)
    llm = engine(args, enable_prefix_caching=False, host_bytes=0)
    ttft(llm, prompt[:64])  # warm-up
    recompute_s = min(ttft(llm, prompt)[0] for _ in range(max(1, repeat)))
    llm.close()
    writer = engine(args, host_bytes=1 << 30, remote_url=url)
    block_bytes = writer.layout.bytes_per_block
    ttft(writer, prompt)
    writer.evict_device_cache()  # device -> host -> remote (write-behind)
    assert writer.store is not None and writer.store.flush(60), "the remote writes did not finish"
    writer.close()
    runs = []
    for _ in range(max(1, repeat)):
        reader = engine(args, host_bytes=1 << 30, remote_url=url)  # empty local tiers
        seconds, m = ttft(reader, prompt)
        assert reader.store is not None
        runs.append((seconds, m, reader.store.stats()["remote"]["round_trips"]))
        reader.close()
    remote_s, m, trips = min(runs, key=lambda x: x[0])
    detail = {"remote_tokens": m.cached_tokens.get("remote", 0), "loading_s": m.loading_s, "model": model.name,
              "layers": writer.layout.num_layers, "block_bytes": block_bytes,
              "bytes": m.cached_tokens.get("remote", 0) // writer.config.block_size * block_bytes,
              "lookup_s": m.stages.get("lookup", 0.0), "fetch_s": m.stages.get("fetch", 0.0), "round_trips": trips,
              "ttft_spread": (sorted(r[0] for r in runs)[len(runs) // 2] / remote_s - 1) * 100,
              "runs": [(r[0], r[1].cached_tokens.get("remote", 0), r[1].stages.get("lookup", 0.0),
                        r[1].stages.get("fetch", 0.0)) for r in runs]}
    row = Row(f"TTFT, {prompt_tokens}-token prompt, prefix only in the remote tier ({model.name})", remote_s,
              recompute_s, "full recompute", ">= 10x", "speedup")
    return row, detail


def render_remote(rows: list[Row], sweep: list[dict[str, Any]], spread: dict[str, Any], where: str,
                  store_detail: dict[str, Any]) -> str:
    text = render(rows, where).replace("## Tiers (`kvstore bench tiers`)", "## Remote tier (`kvstore bench remote`)", 1)
    text = text.replace("Layout: 24 layers", "A local Redis Cluster of 6 `redis-server` 7.0 processes on loopback "
                        "(3 primaries, 3 replicas, `--save '' --appendonly no`), started by the bench. Ours: "
                        "a `TieredStore` with `promotion=\"never\"` (every read goes to the cluster), and "
                        "`RemoteTier` alone (framing + xxh3 checksum, EXISTS before SET, one pipeline per primary "
                        "on a thread each, GET replies read straight into memory of their own). Layout: 24 "
                        "layers", 1)
    lines = [text, "", *render_store(store_detail), "",
             f"Tier rows, spread (median over best, %): get {spread['get']:.0f}, baseline get + copy_ "
             f"{spread['base_get']:.0f}, raw get {spread['raw_get']:.0f}, "
             f"put {spread['put']:.0f}, baseline put {spread['base_put']:.0f}. Median of the per-round "
             f"ratios (each pair run back to back): get {spread['paired_get']:.2f}x (against the raw GET "
             f"{spread['paired_raw_get']:.2f}x), put {spread['paired_put']:.2f}x. Remote read bandwidth "
             f"{spread['read_gbps']:.2f} GB/s.", "",
             f"Load average when the run started: {spread.get('load', 0.0):.1f} on {os.cpu_count()} cores "
             "(the machine is shared; recompute is CPU-bound and slows with it).", "",
             "Hash-tag run length G (blocks of one chain per hash slot), 64-block chains. The default is "
             "G = 1 (docs/remote.md): with one pipeline per primary, all primaries at once, a batch is one "
             "round trip per node for any G, so a larger G only puts a batch on fewer primaries.", "",
             "| G | slots per batch | primaries per batch | get | put |", "|---|---|---|---|---|"]
    for r in sweep:
        lines.append(f"| {r['G']} | {r['slots']} | {r['nodes']} | {r['get_s'] * 1e3:.1f} ms | {r['put_s'] * 1e3:.1f} ms |")
    if "remote_tokens" in spread:
        lines += ["", f"TTFT run: the engine of `kvstore bench engine` ({spread['model']}, {spread['layers']} layers, "
                  f"fp32 KV, {spread['block_bytes'] // 1024} KiB blocks, CPU); "
                  f"{spread['remote_tokens']} prompt tokens came from the remote tier, "
                  f"{spread['bytes'] / 2**20:.1f} MiB fetched in {spread['loading_s'] * 1e3:.0f} ms "
                  f"({spread['bytes'] / max(spread['loading_s'], 1e-9) / 1e9:.2f} GB/s, GETs, checks and "
                  "promotion included); the rest of TTFT is the prefill of the last partial block and the "
                  f"first decode step. Stages of the best run: lookup {spread['lookup_s'] * 1e3:.1f} ms, fetch "
                  f"{spread['fetch_s'] * 1e3:.1f} ms; the engine's store made {spread['round_trips']} round trips "
                  "for the request (its first lookup also discovers the slot map). Every run (TTFT, tokens from "
                  "the remote, lookup, fetch): " + "; ".join(
                      f"{t * 1e3:.0f} ms, {tokens}, {look * 1e3:.1f} ms, {fetch * 1e3:.0f} ms"
                      for t, tokens, look, fetch in spread["runs"]) + "."]
    return "\n".join(lines)


def run_remote_bench(args: argparse.Namespace) -> int:
    try:
        model = BenchModel.from_args(args)
        model.config  # noqa: B018  (a missing or unreadable model fails here, not halfway)
    except CheckpointError as exc:
        print(f"kvstore bench remote: {exc}", file=sys.stderr)
        return 2
    missing = need_binaries()
    if missing is not None:
        print(f"kvstore bench remote: needs a local Redis: {missing}")
        return 2
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-remote-") as tmp:
        load = os.getloadavg()[0]
        print("starting a local Redis Cluster ...", flush=True)
        cluster = RedisCluster.start(Path(tmp), maxmemory=1024 * MIB)
        try:
            seeds = [n.port for n in cluster.nodes[:3]]
            # The baseline's copy_ on one thread, a memcpy as ours is: with torch's intra-op
            # threads a 192 KiB copy_ waits on a second core this shared machine rarely has
            # free (0.3-12 ms each, measured), which would flatter us.
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                print("the store's fetch, get and lookup vs redis-py ...", flush=True)
                rows, store_detail = bench_store(cluster.url, seeds, args.repeat)
                print("the tier's get/put vs redis-py ...", flush=True)
                tier_rows, spread = bench_throughput(cluster.url, seeds, args.repeat)
                rows += tier_rows
                spread["load"] = load
                print("run length sweep ...", flush=True)
                sweep = bench_run_lengths(cluster.url, args.repeat)
            finally:
                torch.set_num_threads(threads)
            if not args.no_ttft:
                print("TTFT through the engine (minutes on a CPU) ...", flush=True)
                ttft_row, detail = bench_ttft(cluster.url, model, args.prompt_tokens, args.ttft_repeat)
                rows.append(ttft_row)
                spread.update(detail)
        finally:
            cluster.close()
    text = render_remote(rows, sweep, spread, machine(), store_detail)
    publish(args, "remote", text)
    return 0


def register_target(targets: argparse._SubParsersAction) -> None:
    """Add ``remote`` to ``kvstore bench``'s targets."""
    p = targets.add_parser("remote", help="remote tier (Redis Cluster) through the store and alone vs redis-py, "
                                          "the G sweep, TTFT from the remote")
    add_model_arguments(p)
    p.add_argument("--repeat", type=positive(int), default=25, help="rounds; the best is kept (default 25)")
    p.add_argument("--prompt-tokens", type=positive(int), default=2048, help="TTFT prompt length (default 2048)")
    p.add_argument("--ttft-repeat", type=positive(int), default=2, help="TTFT runs per side; the best is kept (default 2)")
    p.add_argument("--no-ttft", action="store_true", help="skip the engine TTFT measurement")
    add_output_arguments(p)
    p.set_defaults(func=run_remote_bench)

