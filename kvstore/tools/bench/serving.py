"""``kvstore bench serving``: ``kvstore engine`` against vLLM's OpenAI server, both driven over
HTTP by vLLM's own benchmark client (``vllm.benchmarks.serve``), the same model and the same CPU.
(``--overflow`` runs the other serving benchmark instead: bench.serving_overflow.)

The servers run one at a time, each as its own process, in rounds whose first server
alternates. Each round runs every workload against the server up: vLLM's ``prefix_repetition``
dataset (prompts made of a few long shared prefixes and short suffixes), once at a fixed request
rate (the TTFT that users see when the prefix cache matters) and once per concurrency level with
as many requests in flight as that (TPOT and output throughput under load). The servers and
the client are bench.serving_servers'. vLLM is imported only when the benchmark runs; run it
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
from kvstore.tools.bench.serving_servers import SERVED, Server, reserved_text, run_client
from kvstore.tools.bench.vllm import loaded_from, prepare

SERVERS = ("kvstore", "vllm")
TPOT_TARGET = 0.8  # kvstore's TPOT speed and output throughput, at least this share of vLLM's
TTFT_TARGET = 1.25  # kvstore's mean TTFT at most this many times vLLM's


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


def measure(args: argparse.Namespace, work: Path) -> dict[tuple[str, str], list[dict[str, float]]]:
    """Per (server, workload): one dict of the client's figures per round."""
    tokenizer = args.bench_model.hf_dir(work)
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for round_ in range(args.rounds):
        order = SERVERS if round_ % 2 == 0 else SERVERS[::-1]
        for which in order:
            print(f"round {round_ + 1}/{args.rounds}: starting {which}'s server", flush=True)
            server = Server(which, args, work, args.port)
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
    lines = [
        "## kvstore engine vs vLLM, served (`kvstore bench serving`)",
        "",
        f"Machine: {machine()}. Model: {model.describe()}, fp32 on both sides, {loaded_from(model)}. "
        f"Both servers as their users start them, one at a time: `kvstore engine` (block 16, "
        f"{args.kv_cache_gib} GiB device pool, {args.host_gib} GiB host tier) and vLLM's "
        "`vllm.entrypoints.openai.api_server` "
        f"({args.kv_cache_gib} GiB of KV cache, its default prefix cache and torch.compile"
        f"{', --enforce-eager' if args.enforce_eager else ''}{reserved_text(args)}), "
        "each driven over HTTP by vLLM's own client (`vllm.benchmarks.serve`, `/v1/completions`, one warm-up "
        f"request): its prefix_repetition dataset, prefixes of {args.prefix_tokens} tokens, "
        f"{args.suffix_tokens}-token suffixes, {args.output_tokens} output tokens, greedy, ignore_eos. "
        f"{args.rounds} rounds, the first server alternating; each figure is the mean over the rounds, "
        "spread = (worst - best) / best. Ratios: kvstore over vLLM as speed (above 1: kvstore ahead).",
        "",
        "| workload | measurement | kvstore engine | vLLM | kvstore / vLLM | target | met | spread (kvstore / vLLM) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    missed = []
    for w in workloads(args):
        ours, theirs = results[("kvstore", w.name)], results[("vllm", w.name)]

        def mean(rs: list[dict[str, float]], key: str) -> float:
            return statistics.fmean(r[key] for r in rs)

        rows = [("mean TTFT", "mean_ttft_ms", "ms", True), ("median TTFT", "median_ttft_ms", "ms", True),
                ("mean TPOT", "mean_tpot_ms", "ms", True), ("output throughput", "output_throughput", "tok/s", False)]
        for label, key, unit, lower_is_better in rows:
            a, b = mean(ours, key), mean(theirs, key)
            speed = b / a if lower_is_better else a / b
            if key == "mean_ttft_ms" and w.rate is not None:
                target, want = f">= {1 / TTFT_TARGET:g}x (TTFT <= {TTFT_TARGET}x vLLM's)", 1 / TTFT_TARGET
            elif key in ("mean_tpot_ms", "output_throughput") and w.concurrency is not None:
                target, want = f">= {TPOT_TARGET}x", TPOT_TARGET
            else:
                target, want = "(for reference)", None
            met = "-" if want is None else ("yes" if speed >= want else "NO")
            if met == "NO":
                missed.append(f"{label} at {w.name}")
            shown = ratio_text(speed, want) if want is not None else f"{speed:.2f}"
            lines.append(f"| {w.name} | {label} | {a:.1f} {unit} | {b:.1f} {unit} | {shown}x | {target} | {met} "
                         f"| {_spread([r[key] for r in ours])} / {_spread([r[key] for r in theirs])} |")
    lines += ["", "Missed: " + "; ".join(missed) + "." if missed else "Every target met."]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.vllm_reserved_cpus is not None and args.vllm_reserved_cpus < 0:
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
    p.add_argument("--vllm-reserved-cpus", type=int, default=None, metavar="N",
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for vLLM's server: cores it keeps off its model for its "
                   "frontend (default: unset, vLLM as shipped, which on 2 cores runs its model on 1; 0 gives its model "
                   "every core)")
    overflow.add_arguments(p)
    p.add_argument("--dir", help="where the scratch files go (default: current directory)")
    add_output_arguments(p)
    p.set_defaults(func=run)
