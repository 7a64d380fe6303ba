"""``kvstore replay --layout``: a hybrid layout's runs beside today's replay in the same bytes.

Every (tiers, policy) runs twice or more: once as all-full blocks (``sim.replay``, the
baseline, as ``--layout full`` prints it) and once per ``--cold-blocks`` setting as the
layout's KV groups (``hybrid.replay_groups``), so every ratio is against a baseline measured
in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvstore.config import COLD_BLOCKS
from kvstore.policy.eviction import DEFAULT_POLICY
from kvstore.tools.replay.hybrid import COOL_AT, GroupLayout, GroupReplayResult, replay_groups
from kvstore.tools.replay.sim import ReplayResult, TierSpec, replay
from kvstore.tools.replay.trace import ReplayError, Trace, load_trace

POLICIES = ("reuse", "lru")  # the online policies; Belady's next uses would depend on the hits


def cold_blocks_list(text: str) -> list[str]:
    """``--cold-blocks demote,drop``: one run each."""
    names = [part.strip() for part in text.split(",")]
    for name in names:
        if name not in COLD_BLOCKS:
            raise argparse.ArgumentTypeError(f"unknown cold_blocks setting {name!r}; known: {list(COLD_BLOCKS)}")
    return names


def check_options(args: argparse.Namespace) -> None:
    """ReplayError for the options a grouped replay does not take (or, without a hybrid
    layout, for its own options)."""
    grouped = getattr(args, "layout", None) is not None
    if not grouped:
        if getattr(args, "cold_blocks", None) is not None or getattr(args, "cool_at", None) is not None:
            raise ReplayError("--cold-blocks and --cool-at need a hybrid --layout (gemma3-270m, groups:...)")
        return
    refused = [flag for flag, given in (
        ("--tenants", getattr(args, "tenants", None) is not None), ("--quotas", bool(getattr(args, "quotas", None))),
        ("--plot", bool(args.plot)),
        *((f"--{name}-admission", any(a != "all" for group in getattr(args, f"{name}_admission", None) or []
                                     for a in group)) for name in ("disk", "remote")),
    ) if given]
    if refused:
        raise ReplayError(f"--layout {args.layout.name} replays every tier admitting all, without tenants: "
                          f"leave out {', '.join(refused)}")
    others = sorted(set(args.policy or []) - set(POLICIES))
    if others:
        raise ReplayError(f"--layout {args.layout.name} runs the online policies {list(POLICIES)}, not {others}: "
                          "the optimum's next uses would depend on the hits it replays")


def run(args: argparse.Namespace, configs: list[tuple[TierSpec, ...]]) -> str:
    """Load the trace, replay every configuration, policy and cold_blocks setting, and return
    the table (or the JSON text with ``--json``)."""
    from kvstore.tools.bench.extras import progress_bar

    layout: GroupLayout = args.layout
    trace = load_trace(args.trace)
    policies = list(dict.fromkeys(args.policy or POLICIES))
    colds = list(dict.fromkeys(c for group in args.cold_blocks or [["demote"]] for c in group))
    cool_at = args.cool_at or COOL_AT[0]
    num_runs = len(configs) * len(policies) * (1 + len(colds))
    quiet = args.quiet or not sys.stderr.isatty()
    rows: list[dict[str, Any]] = []
    with progress_bar(trace.num_requests * num_runs, "req", disable=quiet) as bar:
        for tiers in configs:
            for policy in policies:
                base = replay(trace, tiers, policy, bar.update)
                for cold in colds:
                    result = replay_groups(trace, tiers, policy, layout, cold, args.block_tokens, cool_at, bar.update)
                    rows.append(result_row(result, base, cool_at))
    if args.json:
        groups = [{"kind": g.kind, "window_tokens": g.window, "window_blocks": w}
                  for g, w in zip(layout.groups, layout.windows(args.block_tokens), strict=True)]
        return json.dumps({"trace": trace.path, "requests": trace.num_requests, "prompt_blocks": trace.num_blocks,
                           "layout": {"name": layout.name, "groups": groups,
                                      "group_blocks_per_block": layout.group_blocks_per_block},
                           "results": rows}, indent=2)
    return format_table(trace, layout, rows, args.block_tokens)


def result_row(result: GroupReplayResult, base: ReplayResult, cool_at: str) -> dict[str, Any]:
    """One JSON-ready result: the grouped run, and its all-full baseline in the same bytes.
    ``*_group_blocks*`` count group blocks; ``written_blocks_by_tier`` is in all-layers blocks."""
    per = result.group_blocks_per_block
    return {
        "policy": result.policy, "default": result.policy == DEFAULT_POLICY, "layout": result.layout,
        "cold_blocks": result.cold_blocks, "cool_at": cool_at,
        "tier_capacity_blocks": {t.name: t.capacity_blocks for t in result.tiers},
        "tier_capacity_group_blocks": result.tier_group_blocks(), "group_blocks_per_block": per,
        "hit_ratio": result.hit_ratio, "hits": result.hits, "prompt_blocks": result.prompt_blocks,
        "all_full_hit_ratio": base.hit_ratio,
        "x_all_full": result.hit_ratio / base.hit_ratio if base.hit_ratio else None,
        "hits_by_tier": result.hits_by_tier, "all_full_hits_by_tier": base.hits_by_tier,
        "read_group_blocks_by_tier": result.read_blocks, "written_group_blocks_by_tier": result.written_blocks,
        "written_blocks_by_tier": {t: n / per for t, n in result.written_blocks.items()},
        "all_full_written_blocks_by_tier": base.written_blocks,
        "dropped_group_blocks": result.dropped_blocks, "cooled_group_blocks": result.cooled_blocks,
        "cold_dropped_group_blocks": result.cold_dropped_blocks,
        "replay_seconds": round(result.seconds, 3), "all_full_replay_seconds": round(base.seconds, 3),
    }


def format_table(trace: Trace, layout: GroupLayout, rows: list[dict[str, Any]], block_tokens: int) -> str:
    """The grouped runs against all-full blocks in the same bytes; per lower tier, the hits it
    made possible and the blocks written into it (in all-layers blocks: group blocks / G)."""
    per = layout.group_blocks_per_block
    lower = list(rows[0]["tier_capacity_blocks"])[1:]
    head = f"{'policy':<10}{'capacity':>16}{'cold':>8}{'hit ratio':>11}{'all-full':>10}{'x':>8}"
    for t in lower:
        head += f"{t + ' hits':>12}{'written':>10}{'full hits':>11}{'written':>10}"
    lines = [f"{trace.path}: {trace.num_requests} requests, {trace.num_blocks} prompt blocks",
             f"layout {layout.describe(block_tokens)}",
             f"capacities in all-layers blocks: a tier of C holds C x {per} group blocks, the bytes of C blocks of "
             "all-full (--layout full, today's replay, run beside it)",
             head]
    for row in rows:
        name = row["policy"] + ("*" if row["default"] else "")
        caps = "/".join(map(str, row["tier_capacity_blocks"].values()))
        ratio = row["x_all_full"]
        line = f"{name:<10}{caps:>16}{row['cold_blocks']:>8}{row['hit_ratio']:>11.4f}{row['all_full_hit_ratio']:>10.4f}"
        line += f"{ratio:>7.2f}x" if ratio is not None else f"{'-':>8}"
        for t in lower:
            line += f"{row['hits_by_tier'][t]:>12}{row['written_blocks_by_tier'][t]:>10.0f}"
            line += f"{row['all_full_hits_by_tier'][t]:>11}{row['all_full_written_blocks_by_tier'][t]:>10}"
        lines.append(line)
    lines.append("* the default policy; x: hit ratio over all-full's; cold: the cold_blocks setting")
    if lower:
        lines.append("<tier> hits: hit blocks that needed a group block from that tier; written: blocks demoted "
                     f"into it, in all-layers blocks (group blocks / {per}); full hits, written: the same for all-full")
    return "\n".join(lines)
