"""``kvstore bench serving --overflow``: users whose conversations together overflow the device
pool come back, on ``kvstore engine``, on vLLM, and on vLLM with kvstore's connector.

Each user's history is sent once (4 at a time), then the same history with a new turn (one at
a time): by then the device pool, sized to hold ``--pool-users`` conversations, has let the
history go, and what a return costs is what the tiers below it give back. The TTFT of the
returns is the result. The prompts are vLLM's ``sharegpt`` dataset files made here from random
token ids; the servers and vLLM's client are bench.serving_servers'.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

from kvstore.services.common.argtypes import positive
from kvstore.tools.bench.harness import ratio_text
from kvstore.tools.bench.serving_servers import SERVED, Arm, Server, reserved_label, reserved_text, run_client
from kvstore.tools.bench.vllm import Daemon

OVERFLOW_SERVERS = ("kvstore", "vllm", "vllm+kvstore")
LABELS = {"kvstore": "kvstore engine", "vllm": "vLLM, no connector", "vllm+kvstore": "vLLM + kvstore's connector"}
TARGETS = {"vllm": 2.0, "vllm+kvstore": 1.0}  # kvstore's mean TTFT of returning users that many times lower
TURN_TOKENS = 32  # the new turn a returning user adds to their history
SHAREGPT_MAX_PROMPT = 1024  # vLLM's client drops ShareGPT prompts longer than this (its tokenizer's count)


def overflow_files(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """Two files of vLLM's ``sharegpt`` dataset (its JSON loader; the ``custom`` one needs
    pandas): each user's history, then the same history with a new turn. The text is random
    token ids decoded by the model's tokenizer; each return stays within the prompt length the
    client keeps (``check_arguments`` makes sure ``--history-tokens`` leaves room for the turn).
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


def _runs(args: argparse.Namespace) -> list[Arm]:
    """Every run: the engine, then both vLLM servers in each configuration of
    ``--vllm-reserved-cpus``."""
    return [Arm("kvstore"), *(Arm(which, r) for which in OVERFLOW_SERVERS[1:] for r in args.vllm_reserved_cpus)]


def measure_overflow(args: argparse.Namespace, work: Path) -> dict[Arm, dict[str, float]]:
    """Per run: the client's figures for the returning users (the second pass)."""
    histories, returns = overflow_files(args, work)
    tokenizer = args.bench_model.hf_dir(work)
    kv_bytes = overflow_pool_bytes(args)
    results: dict[Arm, dict[str, float]] = {}
    for arm in _runs(args):
        which, reserved = arm.which, arm.reserved
        daemon, server, sockets = None, None, None
        try:
            if which == "vllm+kvstore":  # the socket in a short directory of its own: the scratch one may be deep
                sockets = Path(tempfile.mkdtemp(prefix="kvstore-bench-"))
                daemon = Daemon(work / "daemon", host_mem=f"{args.host_gib}GiB", socket=sockets / "kv.sock")
                daemon.start()
            print(f"overflow: starting {which}'s server" + ("" if which == "kvstore" else
                                                            f" ({reserved_label(reserved)})"), flush=True)
            server = Server(which, args, work, args.port, kv_bytes=kv_bytes, store=daemon.url if daemon else None,
                            max_model_len=SHAREGPT_MAX_PROMPT + args.output_tokens, reserved=reserved)
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
            results[arm] = {k: float(r[k]) for k in ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms")}
            print(f"  {which}: returning users: " + ", ".join(f"{k} {v:.1f}" for k, v in results[arm].items()),
                  flush=True)
        finally:
            if server is not None:
                server.stop()
            if daemon is not None:
                daemon.stop()
            if sockets is not None:
                shutil.rmtree(sockets, ignore_errors=True)
    return results


def render_overflow(results: dict[Arm, dict[str, float]], args: argparse.Namespace) -> str:
    ours = results[Arm("kvstore")]["mean_ttft_ms"]
    configs = "; ".join(reserved_text(r) for r in args.vllm_reserved_cpus)
    lines = [
        "### Conversations that overflow the device pool (`kvstore bench serving --overflow`)",
        "",
        f"{args.users} users, each with a {args.history_tokens}-token history, come back once each, in the "
        f"order they first came, with a {TURN_TOKENS}-token turn ({args.output_tokens} output tokens). Every "
        f"server's device KV pool holds {args.pool_users} conversations ({overflow_pool_bytes(args) / 2**20:.0f} "
        "MiB), so by the time a user returns their history has left it. Lower tiers: the engine's host tier and, for "
        f"vLLM with kvstore's connector, a `kvstore serve` daemon's host tier ({args.host_gib} GiB each). vLLM's "
        "client sends the histories 4 at a time, then the returns one at a time (the TTFT below is theirs), vLLM's "
        f"`sharegpt` dataset loader in its file's order. One run of each server; vLLM in each configuration of its "
        f"cores ({configs}), each judged.",
        "",
        "| server | mean TTFT, returning users | median TTFT | mean TPOT | kvstore's mean TTFT lower by | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in _runs(args):
        r = results[arm]
        label = LABELS[arm.which]
        if arm.which == "kvstore":
            ratio, target, met = "-", "-", "-"
        else:
            label += f" ({reserved_label(arm.reserved)})" if len(args.vllm_reserved_cpus) > 1 else ""
            want = TARGETS[arm.which]
            speed = r["mean_ttft_ms"] / ours
            ratio, target = f"{ratio_text(speed, want)}x", f">= {want:g}x"
            met = "yes" if speed >= want else "NO"
        lines.append(f"| {label} | {r['mean_ttft_ms']:.1f} ms | {r['median_ttft_ms']:.1f} ms | {r['mean_tpot_ms']:.1f} ms "
                     f"| {ratio} | {target} | {met} |")
    return "\n".join(lines)


def check_arguments(args: argparse.Namespace) -> bool:
    """A returning user's prompt must fit what vLLM's client keeps; False (after one line on
    stderr) when ``--history-tokens`` leaves no room for the turn."""
    if args.history_tokens + TURN_TOKENS + 16 <= SHAREGPT_MAX_PROMPT:
        return True
    print(f"kvstore bench serving: --history-tokens {args.history_tokens} leaves no room for a {TURN_TOKENS}-token "
          f"turn: a returning user's prompt must stay within {SHAREGPT_MAX_PROMPT} tokens (vLLM's client drops "
          "longer ShareGPT prompts)", file=sys.stderr)
    return False


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--overflow`` flag and its workload's own options, as a group of ``bench serving``'s."""
    over = p.add_argument_group("the pool-overflow workload (--overflow: instead of the workloads above)")
    over.add_argument("--overflow", action="store_true",
                      help="users whose conversations together overflow the device pool come back: kvstore engine, "
                      "vLLM, and vLLM with kvstore's connector (its own section, serving-overflow)")
    over.add_argument("--users", type=positive(int), default=32, help="conversations (default 32)")
    over.add_argument("--history-tokens", type=positive(int), default=960,
                      help="tokens of each history (default 960; with the turn within vLLM's client's 1,024)")
    over.add_argument("--pool-users", type=positive(int), default=8,
                      help="conversations the device pool holds (default 8)")
