"""``kvstore bench route``: the routing library on a real trace, and its decision time.

1. Trace replay (sim.py): ``conversation_trace.jsonl`` over 4 simulated replicas of C device
   blocks each, for every policy, beside the ceiling (one replica of 4C blocks, 4x as fast).
   The simulation is deterministic: one run per configuration.
2. Decision time: ``Router.route`` of a 2,048-token prompt (hashing included) over 8 replicas
   with 1M indexed blocks, interleaved with the baseline it cannot avoid (hashing alone);
   wall time and the thread's CPU time (the wall p99 of a shared machine measures its
   neighbours: the CPU time shows what the code costs).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstore.keys import BlockHasher, Namespace
from kvstore.layout import KVLayout
from kvstore.services.common.argtypes import positive
from kvstore.services.router.policy.config import (
    CACHE_AWARE,
    LEAST_LOADED,
    POLICIES,
    ROUND_ROBIN,
    RoutingPolicyConfig,
)
from kvstore.services.router.policy.router import Router
from kvstore.services.router.policy.tiers import GPU
from kvstore.tools.bench import extras
from kvstore.tools.bench.output import add_output_arguments, check_plot, image_line, plot_path, publish
from kvstore.tools.replay.route_sim import SimConfig, SimResult, load_requests, simulate
from kvstore.tools.replay.trace import ReplayError

BENCH_NAMESPACE = Namespace("bench-route", KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                                                     dtype=torch.float16))
PLOT = "bench_route.png"  # the plot's name beside --write (under img/)


def replay_rows(path: str, capacities: list[int], sim: SimConfig) -> list[dict[str, Any]]:
    """Every policy and the ceiling at every capacity (one dict per run)."""
    requests = load_requests(path)
    rows = []
    for capacity in capacities:
        config = replace(sim, capacity_blocks=capacity)
        ceiling = simulate(requests, replace(config, num_replicas=1, capacity_blocks=sim.num_replicas * capacity,
                                             prefill_tokens_per_s=sim.num_replicas * sim.prefill_tokens_per_s),
                           RoutingPolicyConfig(policy=ROUND_ROBIN))
        results = {p: simulate(requests, config, RoutingPolicyConfig(policy=p)) for p in POLICIES}
        base = results[ROUND_ROBIN].cached_fraction
        for result in results.values():
            rows.append(_row(capacity, result, base, ceiling.cached_fraction))
        print(f"  C={capacity}: " + ", ".join(f"{r['policy']} {r['cached_fraction']:.4f}" for r in rows[-3:])
              + f", ceiling {ceiling.cached_fraction:.4f}", flush=True)
    return rows


def _row(capacity: int, result: SimResult, base: float, ceiling: float) -> dict[str, Any]:
    ttft = np.array(result.ttft_s)
    return {"capacity": capacity, "policy": result.policy, "cached_fraction": result.cached_fraction,
            "x_round_robin": result.cached_fraction / base, "of_ceiling": result.cached_fraction / ceiling,
            "ceiling": ceiling, "load_spread": result.load_spread, "ttft_mean": float(ttft.mean()),
            "ttft_p90": float(np.percentile(ttft, 90)), "reasons": result.reasons,
            "windows": _window_spread(result.samples)}


def _window_spread(samples: np.ndarray, window_s: int = 300) -> list[float]:
    """max/min over replicas of the mean in-flight prefill tokens, per window of samples."""
    out = []
    for start in range(0, samples.shape[1] - window_s + 1, window_s):
        means = samples[:, start:start + window_s].mean(axis=1)
        out.append(float(means.max() / means.min()) if means.min() > 0 else float("inf"))
    return out


def decision_time(num_blocks: int, num_replicas: int, prompt_tokens: int, rounds: int) -> dict[str, Any]:
    """Route ``rounds`` prompts over an index of ``num_blocks``; percentiles in microseconds."""
    hasher = BlockHasher(BENCH_NAMESPACE)
    router = Router(16, RoutingPolicyConfig(), hasher)
    names = [f"replica-{i}" for i in range(num_replicas)]
    for name in names:
        router.add_replica(name)
    rng = np.random.default_rng(0)
    per_prompt = prompt_tokens // 16
    prompts = []
    for i in range((num_blocks + per_prompt - 1) // per_prompt):  # each prompt on two replicas
        tokens = rng.integers(0, 128_000, prompt_tokens).tolist()
        keys = hasher.block_keys(tokens)
        router.stored(names[i % num_replicas], keys, GPU)
        router.stored(names[(i + 1) % num_replicas], keys[: per_prompt // 2], GPU)
        if i < 256:
            prompts.append(tokens)
    indexed = len(router.index)
    walls, cpus, hash_walls = [], [], []
    for i in range(rounds):  # half cached prefixes (first half of an indexed prompt), half new
        fresh = rng.integers(0, 128_000, prompt_tokens).tolist()
        tokens = fresh if i % 2 else prompts[i % len(prompts)][: prompt_tokens // 2] + fresh[prompt_tokens // 2:]
        t0, c0 = time.perf_counter(), time.thread_time()
        decision = router.route(tokens, now=i * 1e-3)
        cpus.append(time.thread_time() - c0)
        walls.append(time.perf_counter() - t0)
        router.prefill_done(decision)
        router.finished(decision)
        t0 = time.perf_counter()
        hasher.block_keys(tokens)
        hash_walls.append(time.perf_counter() - t0)
    router.index.check_integrity()

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(np.array(xs) * 1e6, q))

    return {"indexed_blocks": indexed, "replicas": num_replicas, "prompt_tokens": prompt_tokens,
            "bytes_per_block": router.index.nbytes / indexed, "rounds": rounds,
            "wall_p50_us": pct(walls, 50), "wall_p99_us": pct(walls, 99), "cpu_p50_us": pct(cpus, 50),
            "cpu_p99_us": pct(cpus, 99), "hash_p50_us": pct(hash_walls, 50), "hash_p99_us": pct(hash_walls, 99),
            "reasons": dict(router.reasons)}


def render(rows: list[dict[str, Any]], timing: list[dict[str, Any]], sim: SimConfig, trace: str,
           where: str) -> str:
    lines = [
        "## Cache-aware routing (`kvstore bench route`)", "",
        f"Machine: {where}. Trace: `{trace}` (Mooncake, 12,031 requests over 59 min, 512-token blocks) "
        f"over {sim.num_replicas} simulated replicas, each a device tier of C blocks under the `{sim.eviction}` "
        f"eviction policy, a FIFO prefill queue at {sim.prefill_tokens_per_s:,.0f} tokens/s and decodes of "
        f"{sim.decode_s_per_token * 1e3:.0f} ms per output token. Ceiling: one replica of "
        f"{sim.num_replicas}C blocks and {sim.num_replicas}x the prefill rate. Load spread: max/min over "
        "replicas of the mean in-flight prefill tokens (sampled each second); the windowed column is the "
        "worst 5-minute window. The simulation is deterministic (one run each).", "",
        "| C (blocks) | policy | cached fraction | x round_robin | of ceiling | load max/min | worst 5-min "
        "| TTFT mean / p90 (s) | target | met |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        target, met = "-", ""
        if r["policy"] == CACHE_AWARE:
            target = ">= 2.5x rr, >= 85% of ceiling, load <= 1.5"
            checks = [r["x_round_robin"] >= 2.5, r["of_ceiling"] >= 0.85, r["load_spread"] <= 1.5]
            met = "yes" if all(checks) else "NO (" + ", ".join(
                n for n, ok in zip(("2.5x", "85%", "load"), checks, strict=True) if not ok) + ")"
        lines.append(
            f"| {r['capacity']:,} | {r['policy']} | {r['cached_fraction']:.4f} | {r['x_round_robin']:.2f}x "
            f"| {r['of_ceiling']:.1%} | {r['load_spread']:.2f} | {max(r['windows'], default=float('nan')):.2f} "
            f"| {r['ttft_mean']:.2f} / {r['ttft_p90']:.2f} | {target} | {met} |")
    lines += ["", "Ceilings (cached fraction of one 4C cache, and that ceiling over round_robin's: no policy of "
              "4 replicas should beat it): " + ", ".join(
                  f"C={r['capacity']:,}: {r['ceiling']:.4f} ({r['x_round_robin'] / r['of_ceiling']:.2f}x)"
                  for r in rows if r["policy"] == CACHE_AWARE) + ".", ""]
    t = timing[0]
    lines += [
        f"Decision time: `Router.route` of a {t['prompt_tokens']:,}-token prompt, SHA-256 hashing included, "
        f"over {t['replicas']} replicas with {t['indexed_blocks']:,} indexed blocks "
        f"({t['bytes_per_block']:.1f} bytes of index per block); {t['rounds']:,} decisions per run, half of "
        "them on a cached prefix; baseline: hashing the same prompt alone, interleaved.", "",
        "| run | route p50 | route p99 | route CPU p50 | route CPU p99 | hashing alone p50 / p99 | target | met |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for i, t in enumerate(timing, start=1):
        lines.append(f"| {i} | {t['wall_p50_us']:.0f} us | {t['wall_p99_us']:.0f} us | {t['cpu_p50_us']:.0f} us "
                     f"| {t['cpu_p99_us']:.0f} us | {t['hash_p50_us']:.0f} / {t['hash_p99_us']:.0f} us "
                     f"| p99 < 1 ms | wall {'yes' if t['wall_p99_us'] < 1000 else 'NO'}, "
                     f"CPU {'yes' if t['cpu_p99_us'] < 1000 else 'NO'} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, capacity: int) -> None:
    """Cached fraction per capacity and the load spread at ``capacity`` (matplotlib: the ``bench`` extra)."""
    plt = extras.pyplot("kvstore bench route's plot")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    caps = sorted({r["capacity"] for r in rows})
    for policy, style in ((CACHE_AWARE, "o-"), (ROUND_ROBIN, "s-"), (LEAST_LOADED, "^-")):
        left.plot(caps, [next(r["cached_fraction"] for r in rows if r["capacity"] == c and r["policy"] == policy)
                         for c in caps], style, label=policy)
    left.plot(caps, [next(r["ceiling"] for r in rows if r["capacity"] == c) for c in caps], "k--",
              label="ceiling (one 4C cache)")
    left.set_xlabel("device blocks per replica (C, 512 tokens each)")
    left.set_ylabel("prompt tokens served from cache")
    left.set_xscale("log")
    left.grid(True, alpha=0.3)
    left.legend()
    for policy in POLICIES:
        row = next(r for r in rows if r["capacity"] == capacity and r["policy"] == policy)
        right.plot(np.arange(len(row["windows"])) * 5, row["windows"], marker=".", label=policy)
    right.axhline(1.5, color="k", linestyle="--", linewidth=1, label="target 1.5")
    right.set_xlabel("minutes into the trace")
    right.set_ylabel("max/min in-flight prefill tokens (5-min windows)")
    right.set_title(f"load spread at C={capacity:,}")
    right.grid(True, alpha=0.3)
    right.legend()
    fig.suptitle("kvstore bench route: conversation trace over 4 replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from kvstore.tools.bench.harness import machine

    if not check_plot(args, PLOT, "kvstore bench route"):
        return 2
    sim = SimConfig(num_replicas=args.replicas, prefill_tokens_per_s=args.prefill_tokens_per_s,
                    decode_s_per_token=args.decode_ms_per_token / 1e3)
    try:
        print(f"trace replay over {args.replicas} replicas ...", flush=True)
        rows = replay_rows(args.trace, args.capacity, sim)
    except ReplayError as exc:
        print(f"kvstore bench route: error: {exc}", file=sys.stderr)
        return 2
    print("decision time ...", flush=True)
    timing = [decision_time(args.index_blocks, 8, 2048, args.rounds) for _ in range(args.repeat)]
    text = render(rows, timing, sim, Path(args.trace).name, machine())
    image = plot_path(args, PLOT)
    if image is not None:
        image.parent.mkdir(parents=True, exist_ok=True)
        plot(rows, image, args.capacity[len(args.capacity) // 2])
        print(f"wrote {image}")
        text += "\n\n" + image_line(args, image, "cached fraction and load spread")
    publish(args, "route", text)
    return 0


def register_target(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("route", help="routing policies on a trace, and the routing decision time")
    p.add_argument("--trace", required=True, help="a Mooncake trace (conversation_trace.jsonl)")
    p.add_argument("--capacity", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 2500, 5000],
                   help="device blocks per replica, a list (default 1000,2500,5000)")
    p.add_argument("--replicas", type=positive(int), default=4, help="simulated replicas (default 4)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0, help="per replica (default 20000)")
    p.add_argument("--decode-ms-per-token", type=float, default=20.0, help="per output token (default 20)")
    p.add_argument("--index-blocks", type=positive(int), default=1_000_000, help="indexed blocks for the timing (1M)")
    p.add_argument("--rounds", type=positive(int), default=2000, help="decisions timed per run (default 2000)")
    p.add_argument("--repeat", type=positive(int), default=3, help="timing runs (default 3)")
    add_output_arguments(p, plot=PLOT)
    p.set_defaults(func=run)
