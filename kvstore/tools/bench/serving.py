"""``kvstore bench serving``: ``kvstore engine`` against vLLM's OpenAI server, both driven over
HTTP by vLLM's own benchmark client (``vllm.benchmarks.serve``), the same model and the same CPU.

The servers run one at a time, each as its own process, in rounds whose first server
alternates. Each round runs every workload against the server up: vLLM's ``prefix_repetition``
dataset (prompts made of a few long shared prefixes and short suffixes), once at a fixed request
rate (the TTFT that users see when the prefix cache matters) and once per concurrency level with
as many requests in flight as that (TPOT and output throughput under load). vLLM is imported
only when the benchmark runs; run it from a venv with vLLM (that of ``make test-vllm``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.services.common.argtypes import positive
from kvstore.tools.bench.harness import machine, ratio_text, scratch_dir, start_service, write_section
from kvstore.tools.bench.models import add_model_arguments
from kvstore.tools.bench.vllm import Daemon, loaded_from, prepare

SERVED = "bench"  # the model name both servers answer to
SERVERS = ("kvstore", "vllm")
TPOT_TARGET = 0.8  # kvstore's TPOT speed and output throughput, at least this share of vLLM's
TTFT_TARGET = 1.25  # kvstore's mean TTFT at most this many times vLLM's
START_TIMEOUT_S = 600.0  # vLLM compiles its model at start: minutes on a small CPU


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


def _errors(log: Path) -> str:
    """The lines of a server's log that name an error (its root cause among them), else its end."""
    lines = log.read_text(errors="replace").splitlines()
    named = [line for line in lines if "Error" in line or "error:" in line]
    return "\n".join(named[-6:]) if named else "\n".join(lines[-20:])


def _wait_for_http(url: str, proc: subprocess.Popen[Any], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited ({proc.returncode}):\n{_errors(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"vLLM's server did not answer {url} in {START_TIMEOUT_S:.0f} s:\n{_errors(log)}")


class Server:
    """One server process, up for a round of workloads: ``kvstore`` (``kvstore engine``),
    ``vllm`` (vLLM's OpenAI server) or ``vllm+kvstore`` (the same with kvstore's connector on the
    daemon at ``store``). ``kv_bytes``: the device KV pool of either server (None: ``--kv-cache-gib``)."""

    def __init__(self, which: str, args: argparse.Namespace, work: Path, port: int, kv_bytes: int | None = None,
                 store: str | None = None, max_model_len: int | None = None) -> None:
        model = args.bench_model
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[Any]
        kv_cache = str(kv_bytes if kv_bytes is not None else args.kv_cache_gib << 30)
        if which == "kvstore":
            # the random model as saved for vLLM: then both servers and the client share its tokenizer
            served = model.server_args() if model.path else ["--model", str(model.hf_dir(work))]
            cmd = [sys.executable, "-m", "kvstore.cli", "engine", *served, "--port", str(port),
                   "--served-model-name", SERVED, "--kv-cache", kv_cache, "--host-mem", f"{args.host_gib}GiB"]
            self.proc, _ = start_service(cmd, "kvstore engine")
            return
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model.hf_dir(work)),
               "--port", str(port), "--host", "127.0.0.1", "--served-model-name", SERVED, "--dtype", "float32",
               "--uvicorn-log-level", "warning"]
        cmd += ["--kv-cache-memory-bytes", kv_cache]
        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine core as vLLM ships it
        if max_model_len is not None:  # vLLM refuses a KV cache smaller than one sequence of the model's length
            cmd += ["--max-model-len", str(max_model_len)]
        if args.enforce_eager:
            cmd.append("--enforce-eager")
        if which == "vllm+kvstore":
            assert store is not None
            connector = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.integrations.vllm",
                         "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                         "kv_connector_extra_config": {"store_url": store}}
            cmd += ["--distributed-executor-backend", "uni", "--kv-transfer-config", json.dumps(connector)]
        log = work / f"{which}-server-{port}.log"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _wait_for_http(f"{self.base_url}/v1/models", self.proc, log)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_client(flags: list[str]) -> dict[str, Any]:
    """vLLM's benchmark client, in this process, as its command line would run it."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return main(parser.parse_args(flags))


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


OVERFLOW_SERVERS = ("kvstore", "vllm", "vllm+kvstore")
OVERFLOW_TARGET = 2.0  # kvstore's mean TTFT of returning users at least this many times lower than vLLM's
TURN_TOKENS = 32  # the new turn a returning user adds to their history


SHAREGPT_MAX_PROMPT = 1024  # vLLM's client drops ShareGPT prompts longer than this (its tokenizer's count)


def overflow_files(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """Two files of vLLM's ``sharegpt`` dataset (its JSON loader; the ``custom`` one needs
    pandas): each user's history, then the same history with a new turn. The text is random
    token ids decoded by the model's tokenizer; each return stays within the prompt length the
    client keeps (``run`` checks that ``--history-tokens`` leaves room for the turn).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.bench_model.hf_dir(work))
    rng = random.Random(0)
    low = min(256, tokenizer.vocab_size // 2)  # clear of the special tokens at the vocabulary's start

    def text(n: int) -> str:
        return str(tokenizer.decode([rng.randrange(low, tokenizer.vocab_size) for _ in range(n)]))

    def count(prompt: str) -> int:
        return len(tokenizer(prompt).input_ids)

    histories, returns = [], []
    for _ in range(args.users):
        history, turn = text(args.history_tokens), text(TURN_TOKENS)
        while count(history + turn) > SHAREGPT_MAX_PROMPT - 8:  # decoding and encoding again may merge or split
            history = history[: int(len(history) * 0.95)]
        histories.append(history)
        returns.append(history + turn)
    files = (work / "histories.json", work / "returns.json")
    for path, prompts in zip(files, (histories, returns), strict=True):
        path.write_text(json.dumps([{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "."}]}
                                    for p in prompts]))
    return files


def overflow_pool_bytes(args: argparse.Namespace) -> int:
    """A device pool that holds ``--pool-users`` users' conversations (with room to spare for
    tokenization's drift and the block rounding), in bytes of fp32 KV."""
    c = args.bench_model.config
    per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4
    tokens = args.history_tokens + TURN_TOKENS + args.output_tokens + 160
    # at least two sequences of the longest prompt vLLM's client sends: vLLM refuses a cache short of one,
    # counted in its blocks of 128 tokens and with some margin of its own
    return max(args.pool_users * tokens, 2 * (SHAREGPT_MAX_PROMPT + args.output_tokens)) * per_token


def measure_overflow(args: argparse.Namespace, work: Path) -> dict[str, dict[str, float]]:
    """Per server: the client's figures for the returning users (the second pass)."""
    histories, returns = overflow_files(args, work)
    tokenizer = args.bench_model.hf_dir(work)
    kv_bytes = overflow_pool_bytes(args)
    results: dict[str, dict[str, float]] = {}
    for which in OVERFLOW_SERVERS:
        daemon, server, sockets = None, None, None
        try:
            if which == "vllm+kvstore":  # the socket in a short directory of its own: the scratch one may be deep
                sockets = Path(tempfile.mkdtemp(prefix="kvstore-bench-"))
                daemon = Daemon(work / "daemon", host_mem=f"{args.host_gib}GiB", socket=sockets / "kv.sock")
                daemon.start()
            print(f"overflow: starting {which}'s server", flush=True)
            server = Server(which, args, work, args.port, kv_bytes=kv_bytes, store=daemon.url if daemon else None,
                            max_model_len=SHAREGPT_MAX_PROMPT + args.output_tokens)
            for path, concurrency in ((histories, 4), (returns, 1)):
                flags = ["--backend", "openai", "--base-url", server.base_url, "--endpoint", "/v1/completions",
                         "--model", SERVED, "--tokenizer", str(tokenizer), "--dataset-name", "sharegpt",
                         "--dataset-path", str(path), "--sharegpt-output-len", str(args.output_tokens),
                         "--disable-shuffle",
                         "--num-prompts", str(args.users), "--max-concurrency", str(concurrency), "--ignore-eos",
                         "--temperature", "0", "--disable-tqdm", "--seed", "0"]
                r = run_client(flags)
                if r["completed"] != args.users or r.get("failed", 0):
                    raise RuntimeError(f"{which}: {r['completed']} of {args.users} requests served")
            results[which] = {k: float(r[k]) for k in ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms")}
            print(f"  {which}: returning users: " + ", ".join(f"{k} {v:.1f}" for k, v in results[which].items()),
                  flush=True)
        finally:
            if server is not None:
                server.stop()
            if daemon is not None:
                daemon.stop()
            if sockets is not None:
                shutil.rmtree(sockets, ignore_errors=True)
    return results


def render_overflow(results: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    ours = results["kvstore"]["mean_ttft_ms"]
    lines = [
        "### Conversations that overflow the device pool (`kvstore bench serving --overflow`)",
        "",
        f"{args.users} users, each with a {args.history_tokens}-token history, come back once each, in the "
        f"order they first came, with a {TURN_TOKENS}-token turn ({args.output_tokens} output tokens). Every "
        f"server's device KV pool holds {args.pool_users} conversations ({overflow_pool_bytes(args) / 2**20:.0f} "
        "MiB), so by the time a user returns their history has left it. Lower tiers: the engine's host tier and, for "
        f"vLLM with kvstore's connector, a `kvstore serve` daemon's host tier ({args.host_gib} GiB each). vLLM's "
        "client sends the histories 4 at a time, then the returns one at a time (the TTFT below is theirs), vLLM's "
        "`sharegpt` dataset loader in its file's order. One run of each server.",
        "",
        "| server | mean TTFT, returning users | median TTFT | mean TPOT | kvstore's mean TTFT lower by | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for which, label, want in (("kvstore", "kvstore engine", None), ("vllm", "vLLM, no connector", OVERFLOW_TARGET),
                               ("vllm+kvstore", "vLLM + kvstore's connector", 1.0)):
        r = results[which]
        if want is None:
            ratio, target, met = "-", "-", "-"
        else:
            speed = r["mean_ttft_ms"] / ours
            ratio, target = f"{ratio_text(speed, want)}x", f">= {want:g}x"
            met = "yes" if speed >= want else "NO"
        lines.append(f"| {label} | {r['mean_ttft_ms']:.1f} ms | {r['median_ttft_ms']:.1f} ms | {r['mean_tpot_ms']:.1f} ms "
                     f"| {ratio} | {target} | {met} |")
    return "\n".join(lines)


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
        f"{', --enforce-eager' if args.enforce_eager else ''}), "
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
    if args.overflow and args.history_tokens + TURN_TOKENS + 16 > SHAREGPT_MAX_PROMPT:
        print(f"kvstore bench serving: --history-tokens {args.history_tokens} leaves no room for a {TURN_TOKENS}-token "
              f"turn: a returning user's prompt must stay within {SHAREGPT_MAX_PROMPT} tokens (vLLM's client drops "
              "longer ShareGPT prompts)", file=sys.stderr)
        return 2
    if not prepare(args, "kvstore bench serving"):
        return 2
    with scratch_dir(args.dir, "serving") as work:
        if args.overflow:
            name, text = "serving-overflow", render_overflow(measure_overflow(args, work), args)
        else:
            name, text = "serving", render(measure(args, work), args)
    print(text)
    if not args.no_write:
        write_section(name, text)
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
    over = p.add_argument_group("the pool-overflow workload (--overflow: instead of the workloads above)")
    over.add_argument("--overflow", action="store_true",
                      help="users whose conversations together overflow the device pool come back: kvstore engine, "
                      "vLLM, and vLLM with kvstore's connector (its own section of docs/benchmarks.md)")
    over.add_argument("--users", type=positive(int), default=32, help="conversations (default 32)")
    over.add_argument("--history-tokens", type=positive(int), default=960,
                      help="tokens of each history (default 960; with the turn within vLLM's client's 1,024)")
    over.add_argument("--pool-users", type=positive(int), default=8,
                      help="conversations the device pool holds (default 8)")
    p.add_argument("--dir", help="where the scratch files go (default: current directory)")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ untouched")
    p.set_defaults(func=run)
