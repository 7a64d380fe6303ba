"""``kvstore bench route-live``: TTFT of a multi-turn chat workload through ``kvstore route``
over real ``kvstore engine`` replicas, cache_aware against round_robin.

Three replica processes, each serving SmolLM2-135M-Instruct by default (``--model`` another
checkpoint; ``--random-model`` a small random Llama, whose CPU prefill of a conversation takes a
fraction of a second), and, per run, one router process with the policy under test. The
workload: ``conversations`` chats in parallel, ``turns`` turns each, every turn's prompt the
whole conversation so far (a distinct system prompt, then user/assistant turns); TTFT is the
time from sending a streamed request to its first token, measured by the official ``openai``
client. Runs alternate the policies, each with fresh prompts (nothing cached from a previous
run counts), ``repeat`` times; the first turn of each chat (a cold prompt for every policy)
is left out of the TTFT figures.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvstore.engine.checkpoint import CheckpointError
from kvstore.services.common.argtypes import positive
from kvstore.tools.bench.models import BenchModel, add_model_arguments
from kvstore.tools.bench.output import add_output_arguments, publish
from kvstore.tools.bench.ports import free_port_pair

RANDOM_MODEL = {"num_layers": 4, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "num_kv_heads": 2,
                "head_dim": 64, "vocab_size": 512}
SERVED_NAME = "bench"  # every replica serves its model under this name


class _Process:
    def __init__(self, args: list[str], what: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", *args],
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{what} exited ({self.proc.wait()}): {''.join(lines)}")
            lines.append(line)
            if line.rstrip().endswith("ready"):
                match = re.search(r"(http://\S+) ", line)
                assert match, line
                self.url = match.group(1)
                threading.Thread(target=lambda: [None for _ in self.proc.stdout or ()], daemon=True).start()
                return
        raise RuntimeError(f"{what} did not start: {''.join(lines)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _chat(url: str, salt: str, conversation: int, turns: int, max_tokens: int) -> list[float]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    messages: list[Any] = [{"role": "system", "content": f"[{salt}/{conversation}] You are a careful assistant who answers "
                 "questions about caching, routing and inference in plain words. " * 12}]
    ttfts = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: how does a prefix cache help here? " * 4})
        started = time.perf_counter()
        stream: Any = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=max_tokens,
                                                     temperature=0, stream=True)
        first, text = None, []
        for chunk in stream:  # a chat stream opens with a role chunk (before prefill): skip it
            if first is None and chunk.choices and all(c.delta.role is None for c in chunk.choices):
                first = time.perf_counter() - started
            text += [c.delta.content or "" for c in chunk.choices]
        assert first is not None
        ttfts.append(first)
        messages.append({"role": "assistant", "content": "".join(text)})
    return ttfts


def run_once(replicas: list[_Process], policy: str, salt: str, args: argparse.Namespace) -> list[float]:
    """One router with ``policy``; every chat's TTFTs after its first turn."""
    router = _Process(["route", *[a for r in replicas for a in ("--replica", r.url)], "--port", "0",
                       "--policy", policy], f"kvstore route --policy {policy}")
    try:
        with ThreadPoolExecutor(args.conversations) as pool:
            per_chat = list(pool.map(lambda c: _chat(router.url, salt, c, args.turns, args.max_tokens),
                                     range(args.conversations)))
    finally:
        router.stop()
    return [t for chat in per_chat for t in chat[1:]]


def run(args: argparse.Namespace) -> int:
    from kvstore.tools.bench.harness import machine

    try:
        model = BenchModel.from_args(args, random=RANDOM_MODEL)
        args.model_description = model.describe()
    except CheckpointError as exc:
        print(f"kvstore bench route-live: {exc}", file=sys.stderr)
        return 2
    print(f"starting {args.replicas} replicas of {model.name} ...", flush=True)
    replicas: list[_Process] = []
    try:
        ports = [free_port_pair() for _ in range(args.replicas)]
        with ThreadPoolExecutor(args.replicas) as pool:
            replicas = list(pool.map(lambda port: _Process(
                ["engine", *model.server_args(), "--served-model-name", SERVED_NAME, "--port", "0",
                 "--kv-events", f"tcp://127.0.0.1:{port}", "--kv-cache", args.kv_cache, "--host-mem", "0"],
                "kvstore engine"), ports))
        results: dict[str, list[list[float]]] = {"cache_aware": [], "round_robin": []}
        for i in range(args.repeat):
            for policy in results:
                ttfts = run_once(replicas, policy, f"run{i}-{policy}", args)
                results[policy].append(ttfts)
                print(f"  run {i + 1} {policy}: mean TTFT {np.mean(ttfts) * 1e3:.0f} ms, "
                      f"p90 {np.percentile(ttfts, 90) * 1e3:.0f} ms ({len(ttfts)} requests)", flush=True)
    finally:
        for r in replicas:
            r.stop()
    text = render(results, args, machine())
    publish(args, "route-live", text)
    return 0


def render(results: dict[str, list[list[float]]], args: argparse.Namespace, where: str) -> str:
    aware, rr = results["cache_aware"], results["round_robin"]
    ratios = [np.mean(b) / np.mean(a) for a, b in zip(aware, rr, strict=True)]
    p90s = [np.percentile(b, 90) / np.percentile(a, 90) for a, b in zip(aware, rr, strict=True)]
    lines = [
        "## Cache-aware routing, live (`kvstore bench route-live`)", "",
        f"Machine: {where}. {args.replicas} `kvstore engine` replicas of {args.model_description}, fp32 on CPU, "
        f"block 16, a {args.kv_cache} device pool, no host tier, behind `kvstore route`; {args.conversations} "
        f"chats in parallel, {args.turns} "
        f"turns each (every prompt the whole conversation so far, {args.max_tokens} tokens out per turn), "
        "streamed through the `openai` client; TTFT = time to the first token (the first chunk after the opening role chunk), turns after the first. "
        f"Policies alternate, fresh prompts each run, {args.repeat} runs each.", "",
        "| run | cache_aware mean / p90 | round_robin mean / p90 | mean TTFT ratio | p90 ratio | target | met |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for i, (a, b) in enumerate(zip(aware, rr, strict=True)):
        lines.append(f"| {i + 1} | {np.mean(a) * 1e3:.0f} / {np.percentile(a, 90) * 1e3:.0f} ms "
                     f"| {np.mean(b) * 1e3:.0f} / {np.percentile(b, 90) * 1e3:.0f} ms | {ratios[i]:.2f}x lower "
                     f"| {p90s[i]:.2f}x | >= 2x lower mean | {'yes' if ratios[i] >= 2 else 'NO'} |")
    lines += ["", f"Spread of the mean-TTFT ratio over the runs: {min(ratios):.2f}-{max(ratios):.2f}x."]
    return "\n".join(lines)


def register_target(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("route-live", help="TTFT through kvstore route over live replicas, cache_aware vs round_robin")
    add_model_arguments(p)
    p.add_argument("--replicas", type=positive(int), default=3, help="engine replicas (default 3)")
    p.add_argument("--kv-cache", default="128MiB", help="each replica's device KV pool (default 128MiB)")
    p.add_argument("--conversations", type=positive(int), default=6, help="chats in parallel (default 6)")
    p.add_argument("--turns", type=positive(int), default=5, help="turns per chat (default 5)")
    p.add_argument("--max-tokens", type=positive(int), default=8, help="tokens generated per turn (default 8)")
    p.add_argument("--repeat", type=positive(int), default=2, help="runs per policy, alternating (default 2)")
    add_output_arguments(p)
    p.set_defaults(func=run)
