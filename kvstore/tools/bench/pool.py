"""``kvstore bench pool``: what a quantized device pool (``kv_cache_dtype`` int8 / fp8) buys and
costs, against a float16 pool, on SmolLM2-135M-Instruct by default (fp32 weights on the CPU).

- capacity: blocks a GiB of pool holds, per format;
- decode tokens/s at batch 1 and 16 (128-token prompts), an int8 pool against a float16 one,
  interleaved rounds, best of each;
- the largest batch of ``--conversation``-token conversations (1,024 by default, each then
  generating ``--decode-tokens``) that a fixed ``--kv-cache`` holds, per format, and two
  throughputs of that whole batch running at once: end to end from cold prompts (prefill
  included), and decode alone (the same batch again, its prompts found in the pool's prefix
  cache: only their last tokens run before decode);
- TTFT of a ``--prompt-tokens`` prefix read back from a cold disk (page cache dropped) stored
  under each lower-tier codec (``--disk-codecs``), against the same prefix stored raw.

Output quality per format is ``kvstore bench quality``'s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvstore.codecs import CODECS
from kvstore.config import StoreSettings
from kvstore.engine.checkpoint import CheckpointError
from kvstore.engine.llm import LLMEngine
from kvstore.engine.sampling import SamplingParams
from kvstore.services.common.argtypes import positive
from kvstore.services.common.sizes import parse_size
from kvstore.tools.bench.harness import drop_page_cache, machine, ratio_text, scratch_dir
from kvstore.tools.bench.models import BenchModel, add_model_arguments
from kvstore.tools.bench.output import add_output_arguments, publish

BLOCK = 16
FORMATS = ("float16", "int8", "fp8")
GIB = 1 << 30


def prompts(model: BenchModel, n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.vocab_size, (n, length), generator=gen).tolist()


def engine(args: argparse.Namespace, kv_cache_dtype: str, kv_cache_bytes: int, **kwargs: Any) -> LLMEngine:
    opts: dict[str, Any] = dict(dtype=torch.float32, block_size=BLOCK, kv_cache_bytes=kv_cache_bytes,
                                kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=4096, max_num_seqs=256,
                                fetch_policy="always")
    if "store_settings" not in kwargs:
        opts["host_bytes"] = 0  # no lower tiers: the pool alone
    opts.update(kwargs)
    return args.bench_model.engine(**opts)


def decode_seconds(llm: LLMEngine, batch: list[list[int]], new: int) -> float:
    """Seconds from the batch's first token to its last: ``new - 1`` decode steps."""
    outs = llm.generate(batch, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    first = min(o.metrics.arrival_s + (o.metrics.ttft_s or 0.0) for o in outs)
    last = max(o.metrics.arrival_s + (o.metrics.latency_s or 0.0) for o in outs)
    return last - first


def bench_decode(args: argparse.Namespace) -> dict[str, float]:
    """Decode tokens/s at batch 1 and 16, an int8 pool against a float16 one, interleaved."""
    r: dict[str, float] = {}
    pool = 64 << 20
    engines = {fmt: engine(args, fmt, pool) for fmt in ("float16", "int8")}
    try:
        for batch in (1, 16):
            batch_prompts = prompts(args.bench_model, batch, 128, seed=batch)
            for llm in engines.values():
                decode_seconds(llm, batch_prompts, 3)  # warm-up
            best = dict.fromkeys(engines, float("inf"))
            for _ in range(args.repeat):
                for fmt, llm in engines.items():
                    best[fmt] = min(best[fmt], decode_seconds(llm, batch_prompts, args.decode_tokens + 1))
            for fmt, seconds in best.items():
                r[f"{fmt}_b{batch}_tps"] = batch * args.decode_tokens / seconds
    finally:
        for llm in engines.values():
            llm.close()
    return r


def bench_capacity(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per format: blocks per GiB, the largest batch of conversations that fits ``--kv-cache``,
    and the decode throughput of that batch running at once."""
    out: dict[str, dict[str, float]] = {}
    per_seq_blocks = -(-(args.conversation + args.decode_tokens) // BLOCK)
    for fmt in FORMATS:
        llm = engine(args, fmt, args.kv_cache_bytes)
        try:
            per_gib = GIB // llm.layout.bytes_per_block
            fits = llm.pool.num_blocks // per_seq_blocks
            print(f"  {fmt}: {llm.pool.num_blocks} blocks in {args.kv_cache}, {fits} conversations of "
                  f"{args.conversation} tokens ...", flush=True)
            batch = prompts(args.bench_model, fits, args.conversation, seed=100)
            params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            outs = llm.generate(batch, params)  # cold: every prompt prefilled
            total = time.perf_counter() - t0
            preempted = sum(o.metrics.num_recomputed_tokens > 0 for o in outs)
            outs = llm.generate(batch, params)  # again: the prompts are in the prefix cache
            first = max(o.metrics.arrival_s + (o.metrics.ttft_s or 0.0) for o in outs)
            last = max(o.metrics.arrival_s + (o.metrics.latency_s or 0.0) for o in outs)
            cached = sum(o.metrics.cached_tokens["device"] for o in outs) / (fits * args.conversation)
            out[fmt] = {"blocks_per_gib": per_gib, "batch": fits, "decode_tps": fits * (args.decode_tokens - 1) / (last - first),
                        "total_tps": fits * args.decode_tokens / total, "preempted": preempted, "cached": cached}
        finally:
            llm.close()
    return out


def bench_disk_codecs(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """Cold-disk TTFT of the ``--prompt-tokens`` prefix stored under each disk codec (and raw)."""
    prompt = prompts(args.bench_model, 1, args.prompt_tokens, seed=7)[0]
    layout = args.bench_model.layout(BLOCK)
    pool = (args.prompt_tokens // BLOCK + 16) * layout.bytes_per_block
    codecs = ["none", *args.disk_codecs]
    best = dict.fromkeys(codecs, float("inf"))

    def tiers(codec: str) -> dict[str, Any]:
        settings = StoreSettings(host_bytes=1 << 30, disk_path=workdir / f"disk-{codec}", disk_bytes=4 << 30,
                                 disk_codec=codec)
        return {"store_settings": settings}

    for codec in codecs:  # compute once; close writes host RAM back to disk
        with engine(args, "auto", pool, **tiers(codec)) as llm:
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    for _ in range(args.repeat):
        for codec in codecs:  # a fresh engine: the disk's catalog is the truth, every block disk-only
            with engine(args, "auto", pool, **tiers(codec)) as llm:
                drop_page_cache(workdir / f"disk-{codec}")
                out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
                if out.metrics.cached_tokens["disk"] < args.prompt_tokens - BLOCK:
                    raise RuntimeError(f"{codec}: only {out.metrics.cached_tokens['disk']} tokens came from disk")
                best[codec] = min(best[codec], out.metrics.ttft_s or 0.0)
    return best


def render(d: dict[str, float], cap: dict[str, dict[str, float]], disk: dict[str, float],
           args: argparse.Namespace) -> str:
    b1, b16 = d["int8_b1_tps"] / d["float16_b1_tps"], d["int8_b16_tps"] / d["float16_b16_tps"]
    rows: list[tuple[str, str, str, str, str, bool | None]] = [
        ("decode, batch 1, int8 pool", f"{d['int8_b1_tps']:.1f} tok/s", f"float16 pool {d['float16_b1_tps']:.1f} tok/s",
         f"{ratio_text(b1, 0.9)}x", ">= 0.9x", b1 >= 0.9),
        ("decode, batch 16, int8 pool", f"{d['int8_b16_tps']:.1f} tok/s",
         f"float16 pool {d['float16_b16_tps']:.1f} tok/s", f"{ratio_text(b16, 0.9)}x", ">= 0.9x", b16 >= 0.9),
    ]
    half = cap["float16"]
    for fmt in ("int8", "fp8"):
        c = cap[fmt]
        x = c["blocks_per_gib"] / half["blocks_per_gib"]
        rows.append((f"blocks per GiB, {fmt} pool", f"{c['blocks_per_gib']:,}", f"float16 {half['blocks_per_gib']:,}",
                     f"{ratio_text(x, 1.9)}x", ">= 1.9x", x >= 1.9))
        rows.append((f"{args.conversation}-token conversations in {args.kv_cache}, {fmt} pool", f"{c['batch']:.0f}",
                     f"float16 {half['batch']:.0f}", f"{c['batch'] / half['batch']:.2f}x", "(for reference)", None))
        tps = c["total_tps"] / half["total_tps"]
        rows.append((f"that whole batch end to end, cold prompts (prefill included), {fmt} pool",
                     f"{c['total_tps']:.1f} tok/s", f"float16, its batch of {half['batch']:.0f}: "
                     f"{half['total_tps']:.1f} tok/s", f"{tps:.2f}x", "(for reference)", None))
        tps = c["decode_tps"] / half["decode_tps"]
        rows.append((f"decode throughput of that whole batch, prompts cached, {fmt} pool", f"{c['decode_tps']:.1f} tok/s",
                     f"float16, its batch of {half['batch']:.0f}: {half['decode_tps']:.1f} tok/s", f"{tps:.2f}x",
                     "(for reference)", None))
    for codec in args.disk_codecs:
        x = disk["none"] / disk[codec]
        rows.append((f"TTFT, {args.prompt_tokens}-token prefix from a cold disk, stored {codec}",
                     f"{disk[codec] * 1e3:.0f} ms", f"stored raw {disk['none'] * 1e3:.0f} ms",
                     f"{x:.2f}x faster" if x >= 1 else f"{1 / x:.2f}x slower",
                     "(for reference)", None))
    preempted = ", ".join(f"{fmt} {cap[fmt]['preempted']:.0f}" for fmt in FORMATS)
    cached = ", ".join(f"{fmt} {cap[fmt]['cached']:.0%}" for fmt in FORMATS)
    lines = [
        "## Quantized device pool (`kvstore bench pool`)",
        "",
        f"Machine: {machine()}. Model: {args.bench_model.describe()}, fp32 weights on the CPU, block {BLOCK}. "
        f"Decode: 128-token prompts, {args.decode_tokens} tokens, from the first token to the last, best of "
        f"{args.repeat} interleaved rounds. Capacity: random {args.conversation}-token prompts, as many as the "
        f"{args.kv_cache} pool holds with {args.decode_tokens} generated tokens each, all submitted at once "
        f"(preempted: {preempted}); end to end: generated tokens over the wall time of the cold batch; decode: "
        f"the same batch again, its prompts from the pool's prefix cache (found: {cached}), from the "
        f"last first token to the last token. Cold disk: a fresh engine per "
        f"run, the page cache dropped, best of {args.repeat}.",
        "",
        "| measurement | quantized | baseline | ratio | target | met |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {r} | {t} | {'-' if ok is None else 'yes' if ok else 'NO'} |"
              for a, b, c, r, t, ok in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        args.bench_model = BenchModel.from_args(args)
        args.bench_model.config  # noqa: B018  (a missing or unreadable model fails here, not halfway)
        args.kv_cache_bytes = parse_size(args.kv_cache)
    except (CheckpointError, ValueError) as exc:
        print(f"kvstore bench pool: {exc}", file=sys.stderr)
        return 2
    unknown = [c for c in args.disk_codecs if c not in CODECS or c == "none"]
    if unknown:
        print(f"kvstore bench pool: --disk-codecs takes lossy codecs of {list(CODECS)}, got {unknown}", file=sys.stderr)
        return 2
    print(f"{args.bench_model.describe()}: decode, int8 pool vs float16 ...", flush=True)
    d = bench_decode(args)
    print("capacity and throughput at a full pool ...", flush=True)
    cap = bench_capacity(args)
    with scratch_dir(args.dir, "pool") as tmp:
        print("cold-disk TTFT per disk codec ...", flush=True)
        disk = bench_disk_codecs(args, tmp)
    text = render(d, cap, disk, args)
    publish(args, "pool", text)
    return 0


def register_target(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("pool", help="a quantized device pool (int8/fp8) vs float16: capacity, decode, batch")
    add_model_arguments(p)
    p.add_argument("--kv-cache", default="256MiB", help="the pool of the capacity rows (default 256MiB)")
    p.add_argument("--conversation", type=positive(int), default=1024,
                   help="tokens of each conversation in the capacity rows (default 1024)")
    p.add_argument("--decode-tokens", type=positive(int), default=32, help="tokens generated per sequence (default 32)")
    p.add_argument("--prompt-tokens", type=positive(int), default=2048, help="the cold-disk prefix (default 2048)")
    p.add_argument("--disk-codecs", type=lambda s: [c for c in s.split(",") if c], default=["int8"],
                   help="lower-tier codecs timed against raw on a cold disk, comma-separated (default int8)")
    p.add_argument("--repeat", type=positive(int), default=3, help="repetitions; the best is kept (default 3)")
    p.add_argument("--dir", help="where the scratch disk tiers go (default: current directory; not tmpfs)")
    add_output_arguments(p)
    p.set_defaults(func=run)
