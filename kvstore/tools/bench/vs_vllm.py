"""``kvstore bench vs-vllm``: the kvstore engine against vLLM, the same model (SmolLM2-135M-Instruct
by default), the same CPU, fp32, in one process, each row's two sides interleaved.

Rows: prefill of a prompt nothing caches, decode at batch 1 and 16, the TTFT of a cached
prefix (the engine's host tier against vLLM with kvstore's connector on a ``kvstore serve``
daemon's host tier, vLLM's own prefix cache off), and for reference the engine over the same
daemon and each engine's own warm prefix cache. A torch profile of a prefill and of a few decode
steps of each says where the time goes (the sides and their timing: bench.vs_vllm_sides). vLLM
is imported only when the benchmark runs.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvstore.engine.llm import LLMEngine
from kvstore.engine.sampling import SamplingParams
from kvstore.services.common.argtypes import positive
from kvstore.tools.bench.harness import machine, ratio_text, scratch_dir
from kvstore.tools.bench.models import BenchModel, add_model_arguments
from kvstore.tools.bench.output import add_output_arguments, publish
from kvstore.tools.bench.vllm import BLOCK as VLLM_BLOCK
from kvstore.tools.bench.vllm import Daemon, loaded_from, prepare, vllm_instance, vllm_ttft
from kvstore.tools.bench.vs_vllm_sides import Ours, Theirs, decode_rate, profile_decode, profiled, ttft

BLOCK = 16  # the engine's block, as in bench engine
TARGET = 0.8  # prefill and decode: kvstore's speed at least this share of vLLM's
TOP_OPS = 5  # ops named per profiled side

Results = dict[str, Any]  # "<row>_ours" / "<row>_vllm": each run's seconds or tokens/s; profiles; facts


def both(r: Results, key: str, i: int, ours: Callable[[], float], theirs: Callable[[], float]) -> None:
    """One sample of each side into ``r``; which goes first alternates with ``i``."""
    pair = [(f"{key}_ours", ours), (f"{key}_vllm", theirs)]
    for name, fn in pair if i % 2 == 0 else pair[::-1]:
        r.setdefault(name, []).append(fn())


def measure(args: argparse.Namespace, work: Path) -> Results:
    model: BenchModel = args.bench_model
    gen = torch.Generator().manual_seed(3)

    def prompts(batch: int, num_tokens: int) -> list[list[int]]:
        return torch.randint(2, model.vocab_size, (batch, num_tokens), generator=gen).tolist()

    decode_blocks = 16 * -(-(args.decode_prompt + args.decode_tokens + 2) // BLOCK)
    pool = (max(-(-(args.prompt_tokens + 1) // BLOCK), decode_blocks) + 16) * model.layout(BLOCK).bytes_per_block

    def engine(**kwargs: Any) -> LLMEngine:
        return model.engine(dtype=torch.float32, block_size=BLOCK, kv_cache_bytes=pool, max_num_batched_tokens=4096,
                            **kwargs)

    r: Results = {"threads": torch.get_num_threads()}
    daemon = Daemon(work, max_namespaces=2)  # the engine's namespace (block 16) and vLLM's (block 128)
    daemon.start()
    engines: list[LLMEngine] = []
    try:
        # Every engine is built before the first vLLM instance: vLLM's CPU worker replaces
        # torch.set_num_threads with a no-op for the whole process, and the engine's one-thread
        # worker (kvstore/engine/threads.py) sets its thread count when the engine is built.
        engines += [engine(enable_prefix_caching=False, host_bytes=0), engine(host_bytes=1 << 30),
                    engine(store_url=daemon.url)]
        plain, host, over_daemon = engines
        r["async_scheduling"] = _speed(r, args, model.hf_dir(work), plain, prompts)
        _cached(r, args, model.hf_dir(work), host, over_daemon, daemon.url, prompts(1, args.prompt_tokens)[0])
    finally:
        for e in engines:
            e.close()
        daemon.stop()
    return r


def _speed(r: Results, args: argparse.Namespace, hf: Path, plain: LLMEngine,
           prompts: Callable[[int, int], list[list[int]]]) -> bool:
    """Prefill and decode, prefix caching off on both sides; whether vLLM scheduled asynchronously."""
    llm = vllm_instance(hf, None, prefix_caching=False)
    ours, theirs = Ours(plain), Theirs(llm)
    long = prompts(1, args.prompt_tokens)[0]
    ttft(plain, long[:64]), vllm_ttft(llm, long[:64])  # warm-up
    for i in range(args.repeat):
        both(r, "prefill", i, partial(ttft, plain, long), partial(vllm_ttft, llm, long))
    if not args.no_profile:
        r["profile_prefill_ours"] = profiled(partial(ttft, plain, long))
        r["profile_prefill_vllm"] = profiled(partial(vllm_ttft, llm, long))
    for batch in (1, 16):
        warm_up = prompts(batch, args.decode_prompt)
        decode_rate(ours, warm_up, 2), decode_rate(theirs, warm_up, 2)
        for i in range(args.repeat):
            batch_prompts = prompts(batch, args.decode_prompt)  # the same prompts for both sides
            both(r, f"decode{batch}", i, partial(decode_rate, ours, batch_prompts, args.decode_tokens),
                 partial(decode_rate, theirs, batch_prompts, args.decode_tokens))
        if not args.no_profile:
            batch_prompts = prompts(batch, args.decode_prompt)
            r[f"profile_decode{batch}_ours"] = profile_decode(ours, batch_prompts, args.profile_steps)
            r[f"profile_decode{batch}_vllm"] = profile_decode(theirs, batch_prompts, args.profile_steps)
    async_scheduling = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    del llm, theirs
    gc.collect()  # vLLM's global state goes with its last reference
    return async_scheduling


def _cached(r: Results, args: argparse.Namespace, hf: Path, host: LLMEngine, over_daemon: LLMEngine, store: str,
            cached: list[int]) -> None:
    """The cached prefix: the engine's embedded host tier and the engine over the daemon at
    ``store``, against vLLM with kvstore's connector on that daemon (vLLM's own prefix cache
    off); then each engine's own warm prefix cache. Also the fewest prompt tokens a hit of each
    found in the store (``<row>_found``)."""
    from kvstore.integrations.vllm import counters, flush

    for e in (host, over_daemon):
        ttft(e, cached)  # computed once: on the device, and written through to the store
        assert e.block_manager.demoter is not None and e.store is not None
        e.block_manager.demoter.drain()
        e.evict_device_cache()
        if not e.store.flush(timeout=120):
            raise RuntimeError("the engine's store did not take the prefix within 120 s")

    def hit(e: LLMEngine, key: str) -> float:
        e.evict_device_cache()  # device -> its store (the blocks are there already: write-through)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        out = e.generate([cached], params)[0]
        seconds = time.perf_counter() - started
        found = sum(n for tier, n in out.metrics.cached_tokens.items() if tier != "device")
        r[key] = min(r.get(key, found), found)
        return seconds

    llm = vllm_instance(hf, store, prefix_caching=False)
    vllm_ttft(llm, cached)  # saved to the daemon
    flush()
    before = counters()["loaded_blocks"]
    for i in range(args.repeat):
        both(r, "host", i, partial(hit, host, "host_found"), partial(vllm_ttft, llm, cached))
        r.setdefault("daemon_ours", []).append(hit(over_daemon, "daemon_found"))
    r["vllm_found"] = (counters()["loaded_blocks"] - before) // args.repeat * VLLM_BLOCK
    del llm
    gc.collect()
    llm = vllm_instance(hf, None, prefix_caching=True)
    vllm_ttft(llm, cached)
    ttft(host, cached)
    for i in range(args.repeat):
        both(r, "warm", i, partial(ttft, host, cached), partial(vllm_ttft, llm, cached))
    del llm
    gc.collect()


def _row(name: str, ours: str, theirs: str, ratio: float, want: float | None, spread: str) -> str:
    """A table row; ``want``: the ratio that meets the target (None: no target)."""
    if want is None:
        return f"| {name} | {ours} | {theirs} | {ratio:.2f}x | (for reference) | - | {spread} |"
    target = f">= {want}x" if want < 1 else f"> {want}x (ahead)"
    met = ratio >= want if want < 1 else ratio > want
    return (f"| {name} | {ours} | {theirs} | {ratio_text(ratio, want)}x | {target} | {'yes' if met else 'NO'} "
            f"| {spread} |")


def _spread(times: list[float]) -> float:
    """(worst - best) / best of times; of rates, (best - worst) / worst: the same of the time per token."""
    return (max(times) - min(times)) / min(times)


def render(r: dict[str, Any], args: argparse.Namespace) -> str:
    import vllm

    def spreads(key: str) -> str:
        return f"{_spread(r[key + '_ours']):.0%} / {_spread(r[key + '_vllm']):.0%}"

    best_s = {k: min(v) for k, v in r.items() if isinstance(v, list) and not k.startswith("decode")}
    best_rate = {k: max(v) for k, v in r.items() if isinstance(v, list) and k.startswith("decode")}
    n = args.prompt_tokens
    ours_pf, theirs_pf = n / best_s["prefill_ours"], n / best_s["prefill_vllm"]
    rows = [_row(f"prefill, {n}-token prompt (a miss: TTFT)", f"{ours_pf:.1f} tok/s ({best_s['prefill_ours'] * 1e3:.0f} ms)",
                 f"{theirs_pf:.1f} tok/s ({best_s['prefill_vllm'] * 1e3:.0f} ms)", ours_pf / theirs_pf, TARGET,
                 spreads("prefill"))]
    for batch in (1, 16):
        ours, theirs = best_rate[f"decode{batch}_ours"], best_rate[f"decode{batch}_vllm"]
        rows.append(_row(f"decode, batch {batch}", f"{ours:.1f} tok/s", f"{theirs:.1f} tok/s", ours / theirs, TARGET,
                         spreads(f"decode{batch}")))
    host, connector = best_s["host_ours"], best_s["host_vllm"]
    rows.append(_row(f"TTFT, cached {n}-token prefix: the engine's host tier / vLLM + kvstore's connector, the "
                     "prefix in a daemon's host tier", f"{host * 1e3:.1f} ms", f"{connector * 1e3:.1f} ms",
                     connector / host, 1, f"{_spread(r['host_ours']):.0%} / {_spread(r['host_vllm']):.0%}"))
    over = best_s["daemon_ours"]
    rows.append(_row("same, the engine over the same daemon (its host tier, as vLLM's connector reads it)",
                     f"{over * 1e3:.1f} ms", f"{connector * 1e3:.1f} ms", connector / over, None,
                     f"{_spread(r['daemon_ours']):.0%} / {_spread(r['host_vllm']):.0%}"))
    warm_ours, warm_vllm = best_s["warm_ours"], best_s["warm_vllm"]
    rows.append(_row("TTFT, each engine's own warm prefix cache (the engine's device pool / vLLM's prefix cache)",
                     f"{warm_ours * 1e3:.1f} ms", f"{warm_vllm * 1e3:.1f} ms", warm_vllm / warm_ours, None,
                     spreads("warm")))
    behind = [f"{name} {ratio_text(ratio, 1)}x" for name, ratio in (
        ("prefill", ours_pf / theirs_pf), ("decode at batch 1", best_rate["decode1_ours"] / best_rate["decode1_vllm"]),
        ("decode at batch 16", best_rate["decode16_ours"] / best_rate["decode16_vllm"])) if ratio < 1]
    verdict = ("kvstore is behind vLLM on " + ", ".join(behind) + " (kvstore's speed over vLLM's)." if behind
               else "kvstore is not behind vLLM on prefill or decode in this run.")
    lines = [
        "## kvstore engine vs vLLM (`kvstore bench vs-vllm`)",
        "",
        f"Machine: {machine()}, vLLM {vllm.__version__} (CPU build), both in one process ({r['threads']} torch "
        f"threads). Model: {args.bench_model.describe()}, fp32 on both sides, {loaded_from(args.bench_model)}. "
        f"vLLM: `enforce_eager=True`, the `uni` executor, 256 MiB of KV cache, its CPU block of {VLLM_BLOCK} tokens, "
        f"async scheduling {'on' if r['async_scheduling'] else 'off'}; the engine: block {BLOCK}, a device pool "
        "sized to the workload. TTFT is the wall time of `generate(max_tokens=1)` on both sides. Prefill and "
        "decode: prefix caching off on both sides. Decode: "
        f"{args.decode_tokens} tokens after {args.decode_prompt}-token prompts, ignore_eos, timed from the step "
        "that returned the first token to the step that returned the last, driving each engine's own step loop "
        "(`LLMEngine.step()`, vLLM's `LLM.llm_engine.step()`), counting the tokens after the first. The cached "
        f"prefix: the engine's embedded host tier (computed once, `evict_device_cache()` before each hit; the "
        f"whole prompt is cached, only its last token runs) against vLLM with kvstore's connector on a "
        f"`kvstore serve` daemon's host tier (vLLM's own prefix cache off; vLLM recomputes the prompt's last "
        f"block of {VLLM_BLOCK} tokens). Every hit of the engine found at least {r['host_found']} of the prompt's "
        f"tokens in its host tier ({r['daemon_found']} over the daemon); vLLM's connector loaded "
        f"{r['vllm_found']} a hit (the mean). Best of {args.repeat} for each side, interleaved (the side that goes "
        "first alternates); the ratio is kvstore's speed over vLLM's (above 1: kvstore ahead).",
        "",
        "| measurement | kvstore engine | vLLM | kvstore / vLLM | target | met | spread (kvstore / vLLM) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Spread: (worst - best) / best over a row's {args.repeat} runs. {verdict}",
    ]
    if not args.no_profile:
        lines += ["", f"Where the time goes (torch profiler, all threads; one prefill, and {args.profile_steps} decode "
                  "steps after the first; self CPU time of the ops in ms, per step for decode; the profiler slows "
                  "both sides):", ""]
        for what, label in (("prefill", "prefill"), ("decode1", "decode step, batch 1"),
                            ("decode16", "decode step, batch 16")):
            for side, name in (("ours", "kvstore engine"), ("vllm", "vLLM")):
                wall, ops = r[f"profile_{what}_{side}"]
                in_ops = sum(ops.values())
                top = ", ".join(f"`{op}` {ms:.1f}" for op, ms in sorted(ops.items(), key=lambda kv: -kv[1])[:TOP_OPS])
                lines.append(f"- {label}, {name}: {wall:.1f} ms, {in_ops:.1f} in torch ops ({top}), "
                             f"{wall - in_ops:.1f} outside them (Python, scheduling, sampling).")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not prepare(args, "kvstore bench vs-vllm"):
        return 2
    with scratch_dir(args.dir, "vs-vllm") as work:
        print(f"{args.bench_model.describe()}: the kvstore engine and vLLM, interleaved ...", flush=True)
        r = measure(args, work)
    text = render(r, args)
    publish(args, "vs-vllm", text)
    return 0


def register_target(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("vs-vllm", help="the kvstore engine vs vLLM: prefill, decode, cached-prefix TTFT "
                           "(SmolLM2; needs vLLM)")
    add_model_arguments(p)
    p.add_argument("--prompt-tokens", type=positive(int), default=2048,
                   help="prefill and cached-prefix prompt length (default 2048)")
    p.add_argument("--decode-prompt", type=positive(int), default=128, help="prompt length of the decode runs (default 128)")
    p.add_argument("--decode-tokens", type=positive(int), default=32, help="decode steps measured (default 32)")
    p.add_argument("--repeat", type=positive(int), default=5, help="repetitions of each side; the best is kept (default 5)")
    p.add_argument("--profile-steps", type=positive(int), default=4,
                   help="decode steps profiled per side and batch (default 4)")
    p.add_argument("--no-profile", action="store_true", help="leave out the profiles of prefill and decode")
    p.add_argument("--dir", help="where the scratch daemon data goes (default: current directory)")
    add_output_arguments(p)
    p.set_defaults(func=run)
