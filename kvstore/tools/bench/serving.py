"""``kvstore bench serving``: ``kvstore engine`` against vLLM's OpenAI server, both driven over
HTTP by vLLM's own benchmark client (``vllm.benchmarks.serve``), the same model and the same CPU.
(``--overflow`` runs the other serving benchmark instead: bench.serving_overflow.)

The servers run one at a time, each as its own process, in rounds whose first server
alternates. Each round runs every workload against the server up: vLLM's ``prefix_repetition``
dataset (prompts made of a few long shared prefixes and short suffixes), once at a fixed request
rate (the TTFT that users see when the prefix cache matters) and once per concurrency level with
as many requests in flight as that (TPOT and output throughput under load). vLLM runs in each
configuration of its cores asked for (as shipped, and with no core reserved for its frontend, by
default): each figure of the engine is judged against the better of them. The servers and the
client are bench.serving_servers'. vLLM is imported only when the benchmark runs; run it
from a venv with vLLM (that of ``make test-vllm``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from kvstore.services.common.argtypes import positive
from kvstore.tools.bench import serving_overflow as overflow
from kvstore.tools.bench.harness import machine, ratio_text, scratch_dir
from kvstore.tools.bench.models import add_model_arguments
from kvstore.tools.bench.output import add_output_arguments, publish
from kvstore.tools.bench.serving_servers import (
    SERVED,
    SHIPPED,
    Arm,
    Server,
    reserved_label,
    reserved_text,
    run_client,
    vllm_configs,
)
from kvstore.tools.bench.vllm import loaded_from, prepare

SPEED_TARGET = 0.9  # kvstore's TPOT speed and output throughput, at least this share of vLLM's (--speed-target)
TTFT_TARGET = 1.1  # kvstore's mean TTFT at the fixed rate, at most this many times vLLM's (--ttft-target)


@dataclass(frozen=True)
class Workload:
    """One run of vLLM's client: ``prefix_repetition`` prompts, sent at ``rate`` requests a second
    (None: all at once) with at most ``concurrency`` in flight (None: no limit)."""

    name: str
    prefixes: int
    requests: int
    rate: float | None
    concurrency: int | None

    def client_args(self, base_url: str, tokenizer: Path, args: argparse.Namespace) -> list[str]:
        flags = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
                 "--model", SERVED, "--tokenizer", str(tokenizer), "--dataset-name", "prefix_repetition",
                 "--prefix-repetition-prefix-len", str(args.prefix_tokens),
                 "--prefix-repetition-suffix-len", str(args.suffix_tokens),
                 "--prefix-repetition-num-prefixes", str(self.prefixes),
                 "--prefix-repetition-output-len", str(args.output_tokens),
                 "--num-prompts", str(self.requests), "--ignore-eos", "--temperature", "0", "--disable-tqdm",
                 "--seed", "0",
                 "--num-warmups", "1"]
        if self.rate is not None:
            flags += ["--request-rate", str(self.rate)]
        if self.concurrency is not None:
            flags += ["--max-concurrency", str(self.concurrency)]
        return flags


def workloads(args: argparse.Namespace) -> list[Workload]:
    paced = Workload(f"{args.rate_requests} requests at {args.rate:g}/s, 2 prefixes", 2, args.rate_requests,
                     args.rate, None)
    loaded = [Workload(f"concurrency {c}, {2 * c} requests, 4 prefixes", 4, 2 * c, None, c)
              for c in args.concurrency]
    return [paced, *loaded]


def arms(args: argparse.Namespace) -> list[Arm]:
    """The engine, then vLLM in each configuration of ``--vllm-reserved-cpus``."""
    return [Arm("kvstore"), *(Arm("vllm", r) for r in args.vllm_reserved_cpus)]


def measure(args: argparse.Namespace, work: Path) -> dict[tuple[str, str], list[dict[str, float]]]:
    """Per (arm's name, workload): one dict of the client's figures per round."""
    tokenizer = args.bench_model.hf_dir(work)
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    servers = arms(args)
    for round_ in range(args.rounds):
        order = servers if round_ % 2 == 0 else servers[::-1]
        for arm in order:
            which = arm.name
            print(f"round {round_ + 1}/{args.rounds}: starting {which}'s server", flush=True)
            server = Server(arm.which, args, work, args.port, reserved=arm.reserved)
            try:
                for w in workloads(args):
                    r = run_client(w.client_args(server.base_url, tokenizer, args))
                    if r["completed"] != w.requests or r.get("failed", 0):
                        raise RuntimeError(f"{which}: {w.name}: {r['completed']} of {w.requests} requests served")
                    figures = {k: float(r[k]) for k in ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
                                                         "output_throughput")}
                    results.setdefault((which, w.name), []).append(figures)
                    print(f"  {which}: {w.name}: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()),
                          flush=True)
            finally:
                server.stop()
    return results


def _spread(values: list[float]) -> str:
    return f"{(max(values) - min(values)) / min(values):.0%}" if min(values) > 0 else "-"


def render(results: dict[tuple[str, str], list[dict[str, float]]], args: argparse.Namespace) -> str:
    model = args.bench_model
    theirs_arms = arms(args)[1:]
    configs = "; ".join(reserved_text(a.reserved) for a in theirs_arms)
    lines = [
        "## kvstore engine vs vLLM, served (`kvstore bench serving`)",
        "",
        f"Machine: {machine()}. Model: {model.describe()}, fp32 on both sides, {loaded_from(model)}. "
        f"The servers as their users start them, one at a time: `kvstore engine` (block 16, "
        f"{args.kv_cache_gib} GiB device pool, {args.host_gib} GiB host tier) and vLLM's "
        "`vllm.entrypoints.openai.api_server` "
        f"({args.kv_cache_gib} GiB of KV cache, its default prefix cache, "
        f"{'no torch.compile (--enforce-eager)' if args.enforce_eager else 'torch.compile'}) in {len(theirs_arms)} "
        f"configuration{'s' if len(theirs_arms) > 1 else ''} of its cores ({configs}), "
        "each driven over HTTP by vLLM's own client (`vllm.benchmarks.serve`, `/v1/completions`, one warm-up "
        f"request): its prefix_repetition dataset, prefixes of {args.prefix_tokens} tokens, "
        f"{args.suffix_tokens}-token suffixes, {args.output_tokens} output tokens, greedy, ignore_eos. "
        f"{args.rounds} round{'s' if args.rounds > 1 else ''}, the order of the servers reversed every other "
        "round; each figure is the mean over the rounds, spread = (worst - best) / best. Baseline: vLLM's better "
        "figure of its configurations (named). Ratios: kvstore over the baseline as speed (above 1: kvstore ahead).",
        "",
        "| workload | measurement | kvstore engine | " + " | ".join(f"vLLM {reserved_label(a.reserved)}" for a in theirs_arms)
        + " | baseline | kvstore / baseline | target | met | spread (kvstore / " + " / ".join(
            reserved_label(a.reserved) for a in theirs_arms) + ") |",
        "|---|---|---|" + "---|" * len(theirs_arms) + "---|---|---|---|---|",
    ]
    missed = []
    for w in workloads(args):
        ours = results[("kvstore", w.name)]

        def mean(rs: list[dict[str, float]], key: str) -> float:
            return statistics.fmean(r[key] for r in rs)

        rows = [("mean TTFT", "mean_ttft_ms", "ms", True), ("median TTFT", "median_ttft_ms", "ms", True),
                ("mean TPOT", "mean_tpot_ms", "ms", True), ("output throughput", "output_throughput", "tok/s", False)]
        for label, key, unit, lower_is_better in rows:
            a = mean(ours, key)
            theirs = [mean(results[(arm.name, w.name)], key) for arm in theirs_arms]
            best = (min if lower_is_better else max)(range(len(theirs)), key=theirs.__getitem__)
            b = theirs[best]
            speed = b / a if lower_is_better else a / b
            if key == "mean_ttft_ms" and w.rate is not None:
                target, want = f">= {1 / args.ttft_target:.2g}x (TTFT <= {args.ttft_target:g}x vLLM's)", 1 / args.ttft_target
            elif key in ("mean_tpot_ms", "output_throughput") and w.concurrency is not None:
                target, want = f">= {args.speed_target:g}x", args.speed_target
            else:
                target, want = "(for reference)", None
            met = "-" if want is None else ("yes" if speed >= want else "NO")
            if met == "NO":
                missed.append(f"{label} at {w.name}")
            shown = ratio_text(speed, want) if want is not None else f"{speed:.2f}"
            cells = " | ".join(f"{t:.1f} {unit}" for t in theirs)
            spreads = " / ".join(_spread([r[key] for r in results[(arm.name, w.name)]]) for arm in theirs_arms)
            lines.append(f"| {w.name} | {label} | {a:.1f} {unit} | {cells} | {reserved_label(theirs_arms[best].reserved)} "
                         f"| {shown}x | {target} | {met} | {_spread([r[key] for r in ours])} / {spreads} |")
    lines += ["", "Missed: " + "; ".join(missed) + "." if missed else "Every target met."]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if any(r is not None and r < 0 for r in args.vllm_reserved_cpus):
        print("kvstore bench serving: --vllm-reserved-cpus must be 0 or more", file=sys.stderr)
        return 2
    if args.overflow and not overflow.check_arguments(args):
        return 2
    if not prepare(args, "kvstore bench serving"):
        return 2
    with scratch_dir(args.dir, "serving") as work:
        if args.overflow:
            name, text = "serving-overflow", overflow.render_overflow(overflow.measure_overflow(args, work), args)
        else:
            name, text = "serving", render(measure(args, work), args)
    publish(args, name, text)
    return 0


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts like 8,32, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be positive, got {text!r}")
    return levels


def register_target(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("serving", help="kvstore engine vs vLLM's server, driven by vLLM's client (needs vLLM)",
                           description="Serve the same model with kvstore engine and with vLLM's OpenAI server, one "
                           "at a time, and drive both with vLLM's benchmark client (vllm.benchmarks.serve): TTFT at "
                           "a fixed request rate, TPOT and output throughput at each concurrency level.")
    add_model_arguments(p)
    p.add_argument("--prefix-tokens", type=positive(int), default=1024, help="shared prefix length (default 1024)")
    p.add_argument("--suffix-tokens", type=positive(int), default=32, help="each prompt's own suffix (default 32)")
    p.add_argument("--output-tokens", type=positive(int), default=32, help="tokens generated a request (default 32)")
    p.add_argument("--rate", type=positive(float), default=1.0, help="request rate of the TTFT run (default 1/s)")
    p.add_argument("--rate-requests", type=positive(int), default=16, help="requests of the TTFT run (default 16)")
    p.add_argument("--concurrency", type=_levels, default=[8, 32], help="concurrency levels (default 8,32)")
    p.add_argument("--rounds", type=positive(int), default=2, help="rounds over both servers (default 2)")
    p.add_argument("--kv-cache-gib", type=positive(int), default=1, help="each server's KV cache (default 1 GiB)")
    p.add_argument("--port", type=positive(int), default=8711, help="the servers' port, one at a time (default 8711)")
    p.add_argument("--host-gib", type=positive(int), default=4,
                   help="host RAM of the engine's store and of the connector's daemon (default 4 GiB)")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile (quick runs, tests)")
    p.add_argument("--vllm-reserved-cpus", type=vllm_configs, default=[None, 0], metavar="LIST",
                   help="vLLM's configurations, comma-separated: each a VLLM_CPU_NUM_OF_RESERVED_CPU (the cores it "
                   f"keeps off its model for its frontend) or '{SHIPPED}' (unset: vLLM as shipped, which on 2 cores "
                   f"runs its model on 1). Every figure is judged against the best of them (default '{SHIPPED},0': "
                   "as shipped and with its model on every core)")
    p.add_argument("--speed-target", type=positive(float), default=SPEED_TARGET,
                   help=f"the TPOT speed and output throughput kvstore must reach, as a share of vLLM's (default "
                   f"{SPEED_TARGET})")
    p.add_argument("--ttft-target", type=positive(float), default=TTFT_TARGET,
                   help=f"the most kvstore's mean TTFT at the fixed rate may be, in vLLM's (default {TTFT_TARGET}x)")
    overflow.add_arguments(p)
    p.add_argument("--dir", help="where the scratch files go (default: current directory)")
    add_output_arguments(p)
    p.set_defaults(func=run)
