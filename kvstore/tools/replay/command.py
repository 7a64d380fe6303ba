"""``kvstore replay``: the command line over the replay loop: options, table, JSON, plot."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvstore.eviction import DEFAULT_POLICY, POLICIES
from kvstore.services.common.argtypes import positive
from kvstore.tools.replay import estimate as est
from kvstore.tools.replay.sim import ReplayResult, TierSpec, replay
from kvstore.tools.replay.trace import ReplayError, Trace, load_trace

BASELINE, OPTIMUM = "lru", "belady"


def _capacities(text: str) -> list[int]:
    parse = positive(int, "a capacity (blocks)")
    return [parse(part.strip()) for part in text.split(",")]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``replay`` subcommand."""
    measured = est.measured_gbps()
    p = subparsers.add_parser(
        "replay", help="replay a Mooncake trace through kvstore's eviction policies",
        description="Replay a Mooncake-format trace (one JSON object a line with hash_ids) through "
        "kvstore's eviction policies, beside LRU and Belady's offline optimum.")
    p.add_argument("trace", help="the trace file (.jsonl)")
    p.add_argument("--capacity", type=_capacities, action="append", metavar="N[,N...]",
                   help="one tier of N blocks; a list (or the option repeated) sweeps capacities")
    p.add_argument("--device", type=positive(int), metavar="N", help="cascade: device tier blocks")
    p.add_argument("--host", type=positive(int), metavar="N", help="cascade: host tier blocks")
    p.add_argument("--disk", type=positive(int), metavar="N", help="cascade: disk tier blocks")
    p.add_argument("--policy", action="append", choices=[*POLICIES, OPTIMUM],
                   help=f"policies to run (repeatable; default: {DEFAULT_POLICY}, {BASELINE}, {OPTIMUM})")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="draw hit ratio vs capacity for every policy")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--block-tokens", type=positive(int), default=est.BLOCK_TOKENS,
                   help="tokens per trace block (default 512, Mooncake's)")
    p.add_argument("--block-bytes", type=positive(int), default=est.BLOCK_BYTES,
                   help="KV bytes per block (default 64 MiB: 512 tokens of Llama-3-8B fp16)")
    p.add_argument("--host-gbps", type=positive(float), default=measured.get("host", est.HOST_GBPS),
                   help="host->device GB/s (default: docs/bench_tiers.json, else 20)")
    p.add_argument("--disk-gbps", type=positive(float), default=measured.get("disk", est.DISK_GBPS),
                   help="disk read GB/s (default: docs/bench_tiers.json, else 3)")
    p.add_argument("--prefill-tokens-per-s", type=positive(float),
                   default=est.PREFILL_TOKENS_PER_S, help="prefill rate used to price a recompute (default 10000)")
    p.set_defaults(func=run)


def tier_configs(args: argparse.Namespace) -> list[tuple[TierSpec, ...]]:
    """The tier configurations to replay; ReplayError for a contradictory choice."""
    cascade = [(name, getattr(args, name)) for name in ("device", "host", "disk")]
    if args.capacity and any(n is not None for _, n in cascade):
        raise ReplayError("give either --capacity or --device/--host/--disk, not both")
    if args.capacity:
        caps = sorted({c for group in args.capacity for c in group})
        return [(TierSpec("device", c),) for c in caps]
    if args.device is None:
        raise ReplayError("give --capacity N[,N...] (one tier) or --device N [--host N] [--disk N]")
    if args.plot:
        raise ReplayError("--plot draws a capacity sweep: use it with --capacity")
    return [tuple(TierSpec(name, n) for name, n in cascade if n is not None)]


def run(args: argparse.Namespace) -> int:
    try:
        configs = tier_configs(args)
        trace = load_trace(args.trace)
        policies = list(dict.fromkeys(args.policy or [DEFAULT_POLICY, BASELINE, OPTIMUM]))
        results = replay_all(trace, configs, policies, show_progress=not args.quiet)
        model = est.CostModel(args.block_tokens, args.block_bytes, args.prefill_tokens_per_s,
                              args.host_gbps, args.disk_gbps)
        rows = [result_row(r, model) for r in results]
        if args.plot:
            plot(rows, Path(args.plot), Path(trace.path).name)
    except ReplayError as exc:
        print(f"kvstore replay: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = {"trace": trace.path, "requests": trace.num_requests, "prompt_blocks": trace.num_blocks,
               "cost_model": vars(model) | {"recompute_seconds_per_block": model.recompute_seconds},
               "results": rows}
        print(json.dumps(out, indent=2))
    else:
        print(format_table(trace, rows))
    return 0


def replay_all(trace: Trace, configs: list[tuple[TierSpec, ...]], policies: list[str],
               show_progress: bool = True) -> list[ReplayResult]:
    """Every policy on every configuration, with one tqdm bar on stderr when it is a TTY."""
    from tqdm import tqdm

    total = trace.num_requests * len(configs) * len(policies)
    with tqdm(total=total, unit="req", file=sys.stderr, leave=False,
              disable=not (show_progress and sys.stderr.isatty())) as bar:
        return [replay(trace, tiers, policy, bar.update) for tiers in configs for policy in policies]


def result_row(result: ReplayResult, model: est.CostModel) -> dict[str, Any]:
    """One JSON-ready result, with the tiered estimate."""
    caps = {t.name: t.capacity_blocks for t in result.tiers}
    return {
        "policy": result.policy, "default": result.policy == DEFAULT_POLICY,
        "capacity_blocks": sum(caps.values()), "tier_capacity_blocks": caps,
        "hit_ratio": result.hit_ratio, "hits": result.hits, "prompt_blocks": result.prompt_blocks,
        "hits_by_tier": result.hits_by_tier, "dropped_blocks": result.dropped_blocks,
        "replay_seconds": round(result.seconds, 3), **est.estimate(result, model),
    }


def format_table(trace: Trace, rows: list[dict[str, Any]]) -> str:
    """The human-readable result: ratios against LRU and Belady of the same configuration."""
    tiers = list(rows[0]["tier_capacity_blocks"])
    ref: dict[tuple[str, str], float] = {}
    for row in rows:
        ref[(row["policy"], str(row["tier_capacity_blocks"]))] = row["hit_ratio"]
    head = f"{'policy':<10}{'capacity':>20}{'hit ratio':>11}{'x lru':>8}{'of belady':>11}"
    head += "".join(f"{t + ' hits':>13}" for t in tiers) + f"{'prefill saved':>15}{'replay s':>10}"
    lines = [f"{trace.path}: {trace.num_requests} requests, {trace.num_blocks} prompt blocks", head]
    for row in rows:
        config = str(row["tier_capacity_blocks"])
        lru, opt = ref.get((BASELINE, config)), ref.get((OPTIMUM, config))
        ratio = row["hit_ratio"]
        name = row["policy"] + ("*" if row["default"] else "")
        line = f"{name:<10}{'/'.join(map(str, row['tier_capacity_blocks'].values())):>20}{ratio:>11.4f}"
        line += f"{ratio / lru:>7.2f}x" if lru else f"{'-':>8}"
        line += f"{ratio / opt:>10.1%} " if opt else f"{'-':>11}"
        line += "".join(f"{row['hits_by_tier'][t]:>13}" for t in tiers)
        line += f"{row['prefill_seconds_saved'] / row['prefill_seconds_total']:>15.1%}"
        lines.append(line + f"{row['replay_seconds']:>10.2f}")
    lines.append("* the default policy; prefill saved: share of all prompt blocks' recompute time")
    if len(tiers) > 1:
        lines.append("GB moved per tier (read up on hits / written by demotion):")
        for row in rows:
            moved = ", ".join(f"{t} {row['bytes_read_by_tier'][t] / 1e9:.0f}/{row['bytes_written_by_tier'][t] / 1e9:.0f}"
                              for t in tiers[1:])
            lines.append(f"  {row['policy']:<10}{moved}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Hit ratio vs capacity, one line per policy (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        points = sorted((r["capacity_blocks"], r["hit_ratio"]) for r in rows if r["policy"] == policy)
        label = f"{policy} (default)" if policy == DEFAULT_POLICY else policy
        ax.plot(*zip(*points, strict=True), marker="o", label=label, linestyle="--" if policy == OPTIMUM else "-")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks of 512 tokens)")
    ax.set_ylabel("hit ratio (prefix blocks found / prompt blocks)")
    ax.set_title(f"kvstore replay: {title}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ReplayError(f"cannot write plot {path}: {exc}") from None
    finally:
        plt.close(fig)
