"""``kvstore bench quality``: what lossy KV does to a real model's output: a lossy codec on the
host tier, or a quantized device pool (``kv_cache_dtype``), each against raw KV in the same run,
on the same prompts and text (the measurements: ``quality_runs``; the text: ``quality_text``).

1. Greedy agreement: chat prompts (the model's chat template), their full blocks served from
   the host tier, then greedy decoding. Teacher-forced (the target's measure): at each of raw
   KV's tokens, whether the variant given raw's tokens before it picks the same. Free-running:
   the variant's own continuation against raw's, the continuations identical in full, and where
   the others first diverge (with raw's top-two logit gap there). The raw run itself is checked
   against a run that reads no cache.
2. Perplexity on this project's own docs (text the model was not tuned on): windows whose
   first ``context`` tokens come from the host tier and whose next ``scored`` tokens are
   scored from the prompt logits of the request (the rows after its cached prefix), the same
   tokens for every variant; also the mean KL divergence from raw KV and top-1 agreement.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

import torch

from kvstore.codecs import CODECS, get_codec
from kvstore.engine.checkpoint import CheckpointError
from kvstore.kernels import PAGE_CODES, packed_head_dim
from kvstore.services.common.argtypes import positive
from kvstore.tools.bench.harness import machine
from kvstore.tools.bench.models import BenchModel, add_model_arguments
from kvstore.tools.bench.output import add_output_arguments, publish
from kvstore.tools.bench.quality_runs import (
    BLOCK,
    POOL,
    RAW,
    Greedy,
    NoCacheCheck,
    Perplexity,
    Variant,
    agreement,
    measure_greedy,
    measure_perplexity,
    open_engines,
    room_blocks,
)
from kvstore.tools.bench.quality_text import PROMPTS, chat_prompts, doc_tokens, text_tokenizer

# Targets by format, the same whether it is a tier's codec or the device pool's (issues 33, 34):
# teacher-forced greedy agreement in % at least; |perplexity / raw's - 1| in % at most
AGREEMENT_TARGETS = {"int8": 95.0, "fp8": 90.0, "int4-rot": 85.0}
PPL_TARGETS = {"int8": 0.5, "fp8": 1.5, "int4-rot": 3.0}


def verdict(value: float, target: float | None, at_least: bool) -> tuple[str, str]:
    if target is None:
        return "-", "-"
    met = value >= target if at_least else value <= target
    return (f">= {target:g}%" if at_least else f"within {target:g}%"), ("yes" if met else "NO")


def target_of(variant: str, targets: dict[str, float]) -> float | None:
    """A format's target, whether the format is a tier's codec or the pool's ("pool:int8")."""
    return targets.get(Variant(variant).pool or variant)


def label(variant: str) -> str:
    v = Variant(variant)
    return f"`{v.pool}` device pool" if v.pool else f"`{variant}` on the host tier"


def blocks_per_gib_ratio(model: BenchModel, variant: str) -> float:
    """Blocks a GiB holds under ``variant`` against float16 blocks (the pool's pages, or a
    tier codec's encoded blocks)."""
    half = model.layout(BLOCK, torch.float16)
    v = Variant(variant)
    if v.pool is not None:
        paged = replace(half, head_dim=packed_head_dim(half.head_dim), dtype=torch.uint8)
        return half.bytes_per_block / paged.bytes_per_block
    return half.bytes_per_block / get_codec(variant).encoded_bytes(half)


def render(model: BenchModel, prompts: list[list[int]], greedy: dict[str, Greedy], num_tokens: int,
           ppl: dict[str, Perplexity], check: NoCacheCheck, text: tuple[int, list[str], str],
           windows: tuple[int, int, int], seconds: float) -> str:
    variants = [c for c in greedy if c != RAW]
    raw = greedy[RAW]
    assert raw.reference is not None
    same = sum(a == b for a, b in zip(raw.tokens, raw.reference, strict=True))
    lengths = sorted(len(p) for p in prompts)
    context, scored, num_windows = windows
    total = len(prompts) * num_tokens
    lines = [
        "## KV quality (`kvstore bench quality`)",
        "",
        f"Machine: {machine()}. Model: {model.describe()}, float32 weights and raw KV, blocks of {BLOCK} tokens. "
        "Each variant is an engine of its own: a lossy codec on its store's host tier (`host_codec`), or a "
        "quantized device pool (`kv_cache_dtype`, raw tiers). A prefix is computed once, evicted from the "
        "device and fetched back (`fetch_policy=\"always\"`), against raw KV (`none`) on the same path. Every "
        "context was checked to come from the host tier (lookup and `cached_tokens[\"host\"]`), lossy for a tier "
        f"codec and exact otherwise. Run time {seconds:.0f} s (1-minute load average at the end "
        f"{os.getloadavg()[0]:.1f}).",
        "",
        f"**Greedy agreement.** {len(prompts)} chat prompts (the model's chat template; {lengths[0]}-{lengths[-1]} "
        f"tokens, {sum(raw.host_tokens):,} of them served by the host tier), {num_tokens} greedy tokens each "
        f"(EOS ignored), against raw KV from the host tier, which gives the tokens of no cache in {same} of "
        f"{len(prompts)} continuations. *Teacher-forced*: at each of raw KV's {total:,} greedy tokens, whether "
        "the variant, given raw's tokens before it, picks the same (the target's measure). *Free-running*: the "
        "variant's own greedy continuation, position by position against raw's (after a first divergence every "
        "later position counts as a miss).",
        "",
        "| KV | teacher-forced equal | target | met | free-running equal | continuations identical "
        "| first divergences: token (raw's top-two logit gap there) | blocks per GiB vs float16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    assert raw.gaps is not None
    for name in variants:
        g = greedy[name]
        assert g.forced is not None
        forced = 100.0 * sum(a == b for x, y in zip(g.forced, raw.tokens, strict=True)
                             for a, b in zip(x, y, strict=True)) / total
        pct, identical, firsts = agreement(g.tokens, raw.tokens)
        target, met = verdict(forced, target_of(name, AGREEMENT_TARGETS), at_least=True)
        where = ", ".join(f"{k} ({raw.gaps[n][k - 1]:.3f})" for n, k in sorted(firsts, key=lambda f: f[1])) or "none"
        lines.append(f"| {label(name)} | {forced:.1f}% | {target} | {met} | {pct:.1f}% | {identical} of {len(prompts)} "
                     f"| {where} | {blocks_per_gib_ratio(model, name):.2f}x |")
    gaps = sorted(g for row in raw.gaps for g in row)
    lines += [
        "",
        f"Raw KV's own continuations hold near-ties: {sum(g < 0.1 for g in gaps)} of {len(gaps):,} positions have "
        f"a top-two logit gap below 0.1 (median gap {gaps[len(gaps) // 2]:.2f}; gaps from a no-cache pass over "
        "prompt and continuation). A free-running continuation flips where the KV's error moves such a gap "
        "past zero, and every later position then counts as a miss; the teacher-forced column counts the "
        "choices themselves.",
    ]
    num_text, files, sha = text
    r = ppl[RAW]
    lines += [
        "",
        f"**Perplexity** on this project's docs ({', '.join(files)}, concatenated: the first {num_text:,} "
        f"tokens; sha256 of the text {sha}). {num_windows} windows of {context + scored + 1:,} tokens, "
        f"one every {scored}: the first {context} tokens of each from the host tier, the next {scored} "
        f"scored, {r.num_scored:,} scored tokens in all, the same for every variant (a quantized pool also "
        "holds the scored rows' own K/V quantized). KL and top-1 are against raw KV's next-token "
        "distribution, per scored token.",
        "",
        "| KV | perplexity | vs raw | mean KL from raw (nats) | top-1 equal to raw's | target | met |",
        "|---|---|---|---|---|---|---|",
        f"| raw (`none`) | {r.ppl:.4f} | - | - | - | - | - |",
    ]
    for name in variants:
        p = ppl[name]
        change = 100.0 * (p.ppl / r.ppl - 1.0)
        target, met = verdict(abs(change), target_of(name, PPL_TARGETS), at_least=False)
        lines.append(f"| {label(name)} | {p.ppl:.4f} | {change:+.3f}% | {p.kl / p.num_scored:.2e} | "
                     f"{100.0 * p.top1 / p.num_scored:.2f}% | {target} | {met} |")
    same_logits = ("logits equal" if check.max_logit_diff == 0 else f"logits within {check.max_logit_diff:.1e} "
                   "(float rounding: the cached context is exact, the batch shapes differ)")
    lines += [
        "",
        f"Raw KV from the host tier against no cache, on the first {check.num_scored:,} scored tokens: "
        f"perplexity {check.ppl_host:.4f} against {check.ppl_no_cache:.4f}, {same_logits}.",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if args.context % BLOCK:
        print(f"kvstore bench quality: --context must be a multiple of {BLOCK}, got {args.context}", file=sys.stderr)
        return 2
    num_windows = -(-args.ppl_tokens // args.scored)
    try:
        model = BenchModel.from_args(args)
        served = text_tokenizer(model)
        tokens, files, sha = doc_tokens(served.encode, num_windows * args.scored + args.context + 1)
    except (CheckpointError, ValueError) as exc:  # no model, or too little text for --ppl-tokens
        print(f"kvstore bench quality: {exc}", file=sys.stderr)
        return 2
    prompts = chat_prompts(served, args.prompts)
    room = room_blocks(prompts, args.tokens, args.context + args.scored + 1, args.group)
    room_bytes = room * model.layout(BLOCK).bytes_per_block
    variants = [*args.codecs, *(f"{POOL}{fmt}" for fmt in args.pools)]
    llms = open_engines(model, variants, room_bytes, room_bytes)
    try:
        print(f"{model.describe()}: greedy, {len(prompts)} prompts x {args.tokens} tokens, "
              f"{', '.join(label(v) for v in variants)} ...", flush=True)
        greedy = measure_greedy(llms, prompts, args.tokens)
        print(f"perplexity: {len(tokens):,} tokens of {', '.join(files)} (sha256 {sha[:16]}...), {num_windows} "
              "windows ...", flush=True)
        ppl, check = measure_perplexity(llms, tokens, args.context, args.scored, args.group,
                                        lambda line: print(line, flush=True))
    finally:
        for llm in llms.values():
            llm.close()
    text = render(model, prompts, greedy, args.tokens, ppl, check, (len(tokens), files, sha),
                  (args.context, args.scored, num_windows), time.perf_counter() - start)
    publish(args, "quality", text)
    return 0


def pool_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    bad = [name for name in names if name not in PAGE_CODES]
    if bad:
        raise argparse.ArgumentTypeError(f"give quantized pool formats from {list(PAGE_CODES)}, comma-separated "
                                         f"(or nothing); got {text!r}")
    return list(dict.fromkeys(names))


def codec_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    lossy = [name for name in CODECS if get_codec(name).lossy]
    bad = [name for name in names if name not in lossy]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"give lossy codecs from {lossy}, comma-separated; got {text!r}")
    return list(dict.fromkeys(names))


def register_target(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("quality", help="lossy codecs on the host tier and quantized device pools vs raw KV: "
                           "greedy agreement and perplexity (SmolLM2)")
    add_model_arguments(p)
    default = [name for name in ("int8", "fp8", "int4-rot", "int4-norot") if name in CODECS]
    p.add_argument("--codecs", type=codec_list, default=default,
                   help=f"lossy codecs on the host tier, comma-separated (default {','.join(default)})")
    p.add_argument("--pools", type=pool_list, default=list(PAGE_CODES),
                   help=f"quantized device pools (kv_cache_dtype), comma-separated; '' for none (default "
                   f"{','.join(PAGE_CODES)})")
    p.add_argument("--prompts", type=positive(int), default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1),
                   metavar=f"1..{len(PROMPTS)}", help=f"chat prompts of the greedy runs (default {len(PROMPTS)})")
    p.add_argument("--tokens", type=positive(int), default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--ppl-tokens", type=positive(int), default=20480,
                   help="scored tokens of the perplexity at least (default 20,480)")
    p.add_argument("--context", type=positive(int), default=512,
                   help=f"tokens of each window from the host tier, a multiple of {BLOCK} (default 512)")
    p.add_argument("--scored", type=positive(int), default=512, help="scored tokens per window (default 512)")
    p.add_argument("--group", type=positive(int), default=2, help="windows per batch (default 2)")
    add_output_arguments(p)
    p.set_defaults(func=run)
