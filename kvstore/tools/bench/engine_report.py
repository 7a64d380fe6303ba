"""``kvstore bench engine``'s report: the table of what it measured, and its plot.

``render`` turns the measurements of bench.engine (TTFT per tier, decode, the served rows of
bench.engine_server) into the markdown section; ``plot`` draws TTFT per tier and decode
throughput (matplotlib, the ``bench`` extra: imported only when a plot is drawn).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvstore.engine.sequence import STAGES
from kvstore.tools.bench import engine_server as served
from kvstore.tools.bench import extras
from kvstore.tools.bench.harness import machine, ratio_text

BLOCK = 16  # the engine's block in every run of bench.engine
HIT_SAMPLES = 3  # host hits timed per repetition (the best of all is kept, as for every row)
HOST_X, DISK_X, REMOTE_X = 50, 20, 10  # TTFT targets against recompute, on SmolLM2 (2,048-token prefix)
PLOT = "bench_engine.png"  # the plot's name beside --write (under img/)


def render(t: dict[str, Any], d: dict[str, Any], tiers: dict[str, Any] | None, args: argparse.Namespace,
           s: dict[str, Any] | None = None) -> str:
    host_x, disk_x = t["recompute_s"] / t["host_s"], t["recompute_s"] / t["disk_s"]
    short_x = t["recompute_s"] / t["short_s"]
    full_x = t["recompute_s"] / t["full_s"]
    b1, b16 = d["ours_b1_tps"] / d["hf_b1_tps"], d["ours_b16_tps"] / d["hf_b16_tps"]
    prefill = d["hf_prefill_s"] / d["ours_prefill_s"]
    rows = [
        ("TTFT, prefix in host tier", f"{t['host_s'] * 1e3:.1f} ms", f"full recompute {t['recompute_s'] * 1e3:.0f} ms",
         f"{ratio_text(host_x, HOST_X)}x faster", f">= {HOST_X}x, <= disk hit",
         host_x >= HOST_X and t["host_s"] <= t["disk_s"]),
        (f"TTFT, prefix in host tier, prompt one token shorter ({t['short_computed']} tokens computed)",
         f"{t['short_s'] * 1e3:.1f} ms", f"full recompute {t['recompute_s'] * 1e3:.0f} ms", f"{short_x:.1f}x faster",
         "(for reference)", None),
        (f"TTFT, prefix in host tier, device pool full (admission evicts {t['full_evictions']} blocks)",
         f"{t['full_s'] * 1e3:.1f} ms", f"full recompute {t['recompute_s'] * 1e3:.0f} ms",
         f"{ratio_text(full_x, HOST_X)}x faster", f">= {HOST_X}x, <= disk hit",
         full_x >= HOST_X and t["full_s"] <= t["disk_s"]),
        ("same, `device_write_policy=\"write_back\"` (admission gathers the victims)",
         f"{t['full_back_s'] * 1e3:.1f} ms", f"full recompute {t['recompute_s'] * 1e3:.0f} ms",
         f"{t['recompute_s'] / t['full_back_s']:.1f}x faster", "(for reference)", None),
        ("TTFT, prefix on disk, page cache dropped", f"{t['disk_s'] * 1e3:.1f} ms",
         f"full recompute {t['recompute_s'] * 1e3:.0f} ms", f"{ratio_text(disk_x, DISK_X)}x faster",
         f">= {DISK_X}x", disk_x >= DISK_X),
    ]
    if "remote_s" in t:
        remote_x = t["recompute_s"] / t["remote_s"]
        rows.append(("TTFT, prefix only in the remote tier (a fresh engine, local Redis Cluster)",
                     f"{t['remote_s'] * 1e3:.1f} ms", f"full recompute {t['recompute_s'] * 1e3:.0f} ms",
                     f"{ratio_text(remote_x, REMOTE_X)}x faster", f">= {REMOTE_X}x", remote_x >= REMOTE_X))
    else:
        rows.append(("TTFT, prefix only in the remote tier", "not measured (no redis-server)", "-", "-",
                     f">= {REMOTE_X}x", None))
    rows += [
        (f"prefill, {args.prompt_tokens}-token prompt (TTFT of a miss)", f"{d['ours_prefill_s'] * 1e3:.0f} ms",
         f"transformers forward {d['hf_prefill_s'] * 1e3:.0f} ms", f"{ratio_text(prefill, 0.9)}x", ">= 0.9x",
         prefill >= 0.9),
        ("decode, batch 1", f"{d['ours_b1_tps']:.1f} tok/s", f"transformers generate {d['hf_b1_tps']:.1f} tok/s",
         f"{ratio_text(b1, 1)}x", ">= 1x", b1 >= 1),
        ("decode, batch 16", f"{d['ours_b16_tps']:.1f} tok/s", f"transformers generate {d['hf_b16_tps']:.1f} tok/s",
         f"{ratio_text(b16, 2)}x", ">= 2x", b16 >= 2),
    ]
    rows += served.rows(s) if s else []
    spreads = ", ".join(f"{name} {t[key]:.0%}" for name, key in (
        ("recompute", "recompute_spread"), ("host hit", "host_spread"), ("disk hit", "disk_spread"),
        ("remote hit", "remote_spread")) if key in t)
    lines = [
        "## Engine (`kvstore bench engine`)",
        "",
        f"Machine: {machine()}. Model: {args.bench_model.describe()}, fp32 on {args.device}; "
        f"block {BLOCK}; prompt {args.prompt_tokens} tokens (found whole in the "
        f"cache, only its last token runs, for its logits; vLLM computes its whole last block again); decode: "
        f"{args.decode_tokens} tokens after {args.decode_prompt}-token prompts; "
        f"best of {args.repeat} ({args.repeat * HIT_SAMPLES} for each host-hit row; "
        f"{t['recompute_runs']} for the recompute, timed between the hits). Spread, (worst - best) / best over a "
        f"row's runs: {spreads}.",
        "",
        "| measurement | kvstore engine | baseline | ratio | target | met |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {r} | {tg} | {'-' if ok is None else 'yes' if ok else 'NO'} |"
              for a, b, c, r, tg, ok in rows]
    lines.append("")
    for tier in ("host", "disk", "remote"):
        if f"{tier}_tokens" not in t:
            continue
        nbytes = t[f"{tier}_tokens"] * t["bytes_per_token"]
        fetch = t[f"{tier}_fetch_s"]
        gbps = (tiers or {}).get(f"{tier}_read_gbps")
        limit = f"; bytes / `bench tiers` bandwidth ({gbps:.2f} GB/s) = {nbytes / gbps / 1e9 * 1e3:.1f} ms, " \
                f"{nbytes / gbps / 1e9 / fetch:.0%} of the limit" if gbps and fetch else \
                " (run `kvstore bench tiers --write docs/benchmarks.md` on this machine first for the physical limit)"
        short = (f" (of the prompt's {args.prompt_tokens}: the tier delivered less, the rest was recomputed)"
                 if t[f"{tier}_tokens"] < args.prompt_tokens - BLOCK else "")
        lines.append(f"- {tier} fetch: {t[f'{tier}_tokens']} tokens{short}, {nbytes / 2**20:.1f} MiB in "
                     f"{fetch * 1e3:.1f} ms ({nbytes / max(fetch, 1e-9) / 1e9:.2f} GB/s){limit}.")
    lines += ["", "Where the time to the first token goes (ms; `RequestMetrics.stages`, best run of each row):", "",
              "| TTFT row | " + " | ".join(STAGES) + " | total |", "|---" * (len(STAGES) + 2) + "|"]
    for name, row in (("host hit", "host"), ("host hit, one token shorter", "short"), ("host hit, pool full", "full"),
                      ("host hit, pool full, write-back", "full_back"), ("disk hit", "disk"),
                      ("remote hit", "remote")):
        if f"{row}_stages" not in t:
            continue
        cells = " | ".join(f"{t[f'{row}_stages'][stage] * 1e3:.1f}" for stage in STAGES)
        lines.append(f"| {name} | {cells} | {t[f'{row}_s'] * 1e3:.1f} |")
    return "\n".join(lines)


def plot(t: dict[str, Any], d: dict[str, Any], path: Path) -> None:
    """TTFT per tier and decode throughput, side by side (matplotlib: the ``bench`` extra)."""
    plt = extras.pyplot("kvstore bench engine's plot")
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = ["recompute", "host hit", "host hit,\npool full", "disk hit"]
    times = [t["recompute_s"], t["host_s"], t["full_s"], t["disk_s"]]
    if "remote_s" in t:
        names.append("remote hit")
        times.append(t["remote_s"])
    a.bar(names, [x * 1e3 for x in times], color=["gray", "C0", "C2", "C1", "C3"][: len(names)])
    a.set_ylabel("TTFT (ms)")
    a.set_yscale("log")
    a.set_title(f"TTFT, {t['host_tokens'] + BLOCK}-token prompt")
    xs = range(2)
    b.bar([x - 0.2 for x in xs], [d["ours_b1_tps"], d["ours_b16_tps"]], 0.4, label="kvstore engine")
    b.bar([x + 0.2 for x in xs], [d["hf_b1_tps"], d["hf_b16_tps"]], 0.4, label="transformers generate")
    b.set_xticks(list(xs), ["batch 1", "batch 16"])
    b.set_ylabel("decode tokens/s")
    b.legend()
    b.set_title("decode throughput")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
