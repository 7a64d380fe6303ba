"""``kvstore replay``: the command line over the replay loop: options, table, JSON, plot."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError
from kvstore.policy.admission import ADMISSIONS
from kvstore.policy.eviction import DEFAULT_POLICY, POLICIES
from kvstore.policy.quotas import QuotaTable
from kvstore.services.common.argtypes import positive
from kvstore.services.common.sizes import parse_size
from kvstore.tools.replay import estimate as est
from kvstore.tools.replay import hybrid_command
from kvstore.tools.replay.hybrid import COOL_AT, GroupLayout, parse_layout
from kvstore.tools.replay.sim import ReplayResult, TierSpec, replay
from kvstore.tools.replay.trace import ReplayError, Trace, load_trace

BASELINE, OPTIMUM = "lru", "belady"


def _capacities(text: str) -> list[int]:
    parse = positive(int, "a capacity (blocks)")
    return [parse(part.strip()) for part in text.split(",")]


def _admissions(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",")]
    for name in names:
        if name not in ADMISSIONS:
            raise argparse.ArgumentTypeError(f"unknown admission policy {name!r}; known: {list(ADMISSIONS)}")
    return names


def _layout(text: str) -> GroupLayout | None:
    try:
        return parse_layout(text)
    except ReplayError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--layout ")) from None


def quota_setting(spec: str, trace: Trace) -> tuple[str, QuotaTable | None]:
    """``--quotas SPEC``: "none", "equal" (an equal soft share of every tier per tenant), or a
    TOML file of ``[quotas.TENANT]`` tables (as ``kvstore serve --config`` takes). Its label
    and table. ReplayError for a file that cannot be read or holds a bad quota."""
    if spec == "none":
        return spec, None
    if spec == "equal":
        return spec, QuotaTable.equal_shares(trace.tenant_names)
    import tomllib

    try:
        with open(spec, "rb") as f:
            doc = tomllib.load(f)
        table = QuotaTable.from_dict(doc.get("quotas", {}), parse_size, where=f"{spec}: quotas")
    except (OSError, UnicodeDecodeError, RecursionError, tomllib.TOMLDecodeError, ConfigError) as exc:
        # (tomllib decodes the bytes itself, and nests by recursion: not UTF-8, or too deep)
        raise ReplayError(f"--quotas {spec}: {exc}") from None
    unknown = sorted(set(table.tenants) - set(trace.tenant_names))
    if unknown:
        raise ReplayError(f"--quotas {spec}: tenants {unknown} are not the trace's {trace.tenant_names}")
    return Path(spec).name, table


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
    p.add_argument("--remote", type=positive(int), metavar="N",
                   help="cascade: a remote tier of N blocks below the rest (LRU, as Redis evicts; its "
                   "victims hidden from admission)")
    p.add_argument("--disk-admission", type=_admissions, action="append", metavar="A[,B...]",
                   help=f"admission of the disk tier, one run each ({', '.join(ADMISSIONS)}; default all)")
    p.add_argument("--remote-admission", type=_admissions, action="append", metavar="A[,B...]",
                   help="admission of the remote tier, one run each (default all)")
    p.add_argument("--tenants", type=positive(int), metavar="N",
                   help="derive N tenants for a trace whose lines name none (docs/eviction.md)")
    p.add_argument("--quotas", action="append", metavar="SPEC",
                   help="quota setting to run, repeatable: none, equal (equal soft shares), or a TOML file "
                   "of [quotas.TENANT] tables (default none)")
    p.add_argument("--policy", action="append", choices=[*POLICIES, OPTIMUM],
                   help=f"policies to run (repeatable; default: {DEFAULT_POLICY}, {BASELINE}, {OPTIMUM})")
    p.add_argument("--layout", type=_layout, metavar="SPEC",
                   help="replay as a model's KV groups, beside all-full blocks in the same bytes: full (today's "
                   "replay, the default), gemma3-270m, or groups:TERM+TERM... with TERM <count>f (full "
                   "attention) or <count>s<W> (sliding window of W tokens), e.g. groups:1f+5s512")
    p.add_argument("--cold-blocks", type=hybrid_command.cold_blocks_list, action="append", metavar="S[,S...]",
                   help="with --layout: what a tier's eviction does with a cooled sliding-window block, one run "
                   "each: demote (write it down the tiers, the default) or drop")
    p.add_argument("--cool-at", choices=COOL_AT,
                   help="with --layout: where a request ends, for cooling: its full prompt blocks "
                   "(input_length // block tokens, the default) or its last id")
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
    """The tier configurations to replay (one per capacity, and per admission choice of the
    disk and remote tiers); ReplayError for a contradictory choice."""
    cascade = [(name, getattr(args, name, None)) for name in ("device", "host", "disk", "remote")]
    if args.capacity and any(n is not None for _, n in cascade):
        raise ReplayError("give either --capacity or --device/--host/--disk/--remote, not both")
    if args.capacity:
        caps = sorted({c for group in args.capacity for c in group})
        return [(TierSpec("device", c),) for c in caps]
    given = [(name, n) for name, n in cascade if n is not None]
    if not given or (len(given) == 1 and given[0][0] in ("disk", "remote")):
        raise ReplayError("give --capacity N[,N...] (one tier) or a cascade: --device N and/or --host N, "
                          "then [--disk N] [--remote N]")
    if args.plot:
        raise ReplayError("--plot draws a capacity sweep: use it with --capacity")
    disk = list(dict.fromkeys(a for group in getattr(args, "disk_admission", None) or [["all"]] for a in group))
    remote = list(dict.fromkeys(a for group in getattr(args, "remote_admission", None) or [["all"]] for a in group))
    if (disk != ["all"] and args.disk is None) or (remote != ["all"] and getattr(args, "remote", None) is None):
        raise ReplayError("--disk-admission needs a --disk tier, --remote-admission a --remote tier")
    out = []
    for d, r in itertools.product(disk, remote):
        out.append(tuple(TierSpec(name, n, d if name == "disk" else r if name == "remote" else "all",
                                  shared=name == "remote") for name, n in given))
    return out


def run(args: argparse.Namespace) -> int:
    from kvstore.tools.bench.extras import MissingExtra, require

    try:
        if args.plot:
            require("matplotlib", "--plot")  # before the replay, not after it
        configs = tier_configs(args)
        hybrid_command.check_options(args)
        if getattr(args, "layout", None) is not None:
            print(hybrid_command.run(args, configs))
            return 0
        trace = load_trace(args.trace, tenants=getattr(args, "tenants", None))
        policies = list(dict.fromkeys(args.policy or [DEFAULT_POLICY, BASELINE, OPTIMUM]))
        quotas = [quota_setting(spec, trace) for spec in dict.fromkeys(getattr(args, "quotas", None) or ["none"])]
        if any(table is not None for _, table in quotas) and not trace.tenants:
            raise ReplayError("quotas need tenants: a trace whose lines name them, or --tenants N")
        results = replay_all(trace, configs, policies, show_progress=not args.quiet, quotas=quotas,
                             block_bytes=args.block_bytes)
        model = est.CostModel(args.block_tokens, args.block_bytes, args.prefill_tokens_per_s,
                              args.host_gbps, args.disk_gbps)
        rows = [result_row(r, model) for r in results]
        if args.plot:
            plot(rows, Path(args.plot), Path(trace.path).name)
    except (ReplayError, MissingExtra) as exc:
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
               show_progress: bool = True, quotas: list[tuple[str, QuotaTable | None]] | None = None,
               block_bytes: int = 1) -> list[ReplayResult]:
    """Every policy on every configuration under every quota setting, with one progress bar on
    stderr when it is a TTY (tqdm's, or plain lines without it). Belady, the reference, runs
    once per capacity: every tier admitting all, no quota."""
    from kvstore.tools.bench.extras import progress_bar

    settings = quotas or [("none", None)]
    runs: list[tuple[tuple[TierSpec, ...], str, str, QuotaTable | None]] = []
    belady_done: set[tuple[int, ...]] = set()
    for tiers, policy, (label, table) in itertools.product(configs, policies, settings):
        if policy == OPTIMUM:
            caps = tuple(t.capacity_blocks for t in tiers)
            if caps in belady_done:
                continue
            belady_done.add(caps)
            tiers, label, table = tuple(dataclasses.replace(t, admission="all") for t in tiers), "none", None
        runs.append((tiers, policy, label, table))
    quiet = not (show_progress and sys.stderr.isatty())
    with progress_bar(trace.num_requests * len(runs), "req", disable=quiet) as bar:
        return [replay(trace, tiers, policy, bar.update, table, label, block_bytes)
                for tiers, policy, label, table in runs]


def result_row(result: ReplayResult, model: est.CostModel) -> dict[str, Any]:
    """One JSON-ready result, with the tiered estimate."""
    caps = {t.name: t.capacity_blocks for t in result.tiers}
    return {
        "policy": result.policy, "default": result.policy == DEFAULT_POLICY,
        "capacity_blocks": sum(caps.values()), "tier_capacity_blocks": caps,
        "admission": result.admission, "quotas": result.quotas,
        "hit_ratio": result.hit_ratio, "hits": result.hits, "prompt_blocks": result.prompt_blocks,
        "hits_by_tier": result.hits_by_tier, "dropped_blocks": result.dropped_blocks,
        "written_blocks_by_tier": result.written_blocks, "refused_blocks": result.refused_blocks,
        "hit_ratio_by_tenant": result.tenant_hit_ratios(),
        "replay_seconds": round(result.seconds, 3), **est.estimate(result, model),
    }


def format_table(trace: Trace, rows: list[dict[str, Any]]) -> str:
    """The human-readable result: ratios against LRU and Belady of the same configuration."""
    tiers = list(rows[0]["tier_capacity_blocks"])
    ref: dict[tuple[str, str], float] = {}
    for row in rows:  # LRU's of the same admission and quotas; Belady's of the same capacities
        variant = "" if row["policy"] == OPTIMUM else f"{row['admission']}/{row['quotas']}"
        ref[(row["policy"], str(row["tier_capacity_blocks"]) + variant)] = row["hit_ratio"]
    varied = len({(r["admission"], r["quotas"]) for r in rows}) > 1 or rows[0]["quotas"] != "none"
    head = f"{'policy':<10}{'capacity':>20}" + (f"{'admission':>22}{'quotas':>10}" if varied else "")
    head += f"{'hit ratio':>11}{'x lru':>8}{'of belady':>11}"
    head += "".join(f"{t + ' hits':>13}" for t in tiers) + f"{'prefill saved':>15}{'replay s':>10}"
    lines = [f"{trace.path}: {trace.num_requests} requests, {trace.num_blocks} prompt blocks", head]
    for row in rows:
        config = str(row["tier_capacity_blocks"])
        variant = f"{row['admission']}/{row['quotas']}"
        lru, opt = ref.get((BASELINE, config + variant)), ref.get((OPTIMUM, config))
        ratio = row["hit_ratio"]
        name = row["policy"] + ("*" if row["default"] else "")
        line = f"{name:<10}{'/'.join(map(str, row['tier_capacity_blocks'].values())):>20}"
        if varied:
            line += f"{row['admission']:>22}{row['quotas']:>10}"
        line += f"{ratio:>11.4f}"
        line += f"{ratio / lru:>7.2f}x" if lru else f"{'-':>8}"
        line += f"{ratio / opt:>10.1%} " if opt else f"{'-':>11}"
        line += "".join(f"{row['hits_by_tier'][t]:>13}" for t in tiers)
        line += f"{row['prefill_seconds_saved'] / row['prefill_seconds_total']:>15.1%}"
        lines.append(line + f"{row['replay_seconds']:>10.2f}")
    lines.append("* the default policy; prefill saved: share of all prompt blocks' recompute time")
    if len(rows[0]["hit_ratio_by_tenant"]) > 1:
        lines.append("hit ratio by tenant" + (" (blocks refused at hard quotas)" if any(
            r["refused_blocks"] for r in rows) else "") + ":")
        for row in rows:
            per = ", ".join(f"{t} {v:.4f}" for t, v in sorted(row["hit_ratio_by_tenant"].items()))
            refused = f" (refused {row['refused_blocks']})" if row["refused_blocks"] else ""
            lines.append(f"  {row['policy']:<8} {row['admission']}/{row['quotas']}: {per}{refused}")
    if len(tiers) > 1:
        lines.append("GB moved per tier (read up on hits / written by demotion):")
        for row in rows:
            moved = ", ".join(f"{t} {row['bytes_read_by_tier'][t] / 1e9:.0f}/{row['bytes_written_by_tier'][t] / 1e9:.0f}"
                              for t in tiers[1:])
            lines.append(f"  {row['policy']:<10}{row['admission']:<22}{moved}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Hit ratio vs capacity, one line per policy (matplotlib, the ``bench`` extra)."""
    from kvstore.tools.bench.extras import pyplot

    plt = pyplot("kvstore replay --plot")

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
