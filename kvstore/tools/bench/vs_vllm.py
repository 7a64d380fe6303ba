"""``kvstore bench vs-vllm``: the kvstore engine against vLLM, the same model (SmolLM2-135M-Instruct
by default), the same CPU, fp32, in one process, each row's two sides interleaved.

Rows: prefill of a prompt nothing caches, decode at batch 1, 8 and 32, the TTFT of a cached
prefix (the engine's host tier against vLLM with kvstore's connector on a ``kvstore serve``
daemon's host tier, vLLM's own prefix cache off), and for reference the engine over the same
daemon, each engine's own warm prefix cache, and a next turn (a few new tokens over the cached
prefix) from each one's warm cache. The engine alone: a next turn with the prefix in its host
tier, against twice the copy of the prefix's bytes plus the same new tokens' prefill with no
context, all timed in the same run. A torch profile of a prefill, of a next turn and of a few
decode steps of each says where the time goes (the sides and their timing:
bench.vs_vllm_sides). vLLM is imported only when the benchmark runs. In one process (the
``uni`` executor) vLLM reserves no core for a frontend: ``VLLM_CPU_NUM_OF_RESERVED_CPU`` binds
the threads of its multiprocess engine core, which this benchmark does not start; the table
says how many threads vLLM's model had.
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
DECODE_BATCHES = (1, 8, 32)
TURN_BOUND = 2.0  # a next turn from host RAM: at most this many times (prefix copy + its new tokens' prefill)
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

    decode_blocks = max(DECODE_BATCHES) * -(-(args.decode_prompt + args.decode_tokens + 3) // BLOCK)
    prompt_blocks = -(-(args.prompt_tokens + args.turn_tokens + 1) // BLOCK)
    pool = (max(2 * prompt_blocks, decode_blocks) + 16) * model.layout(BLOCK).bytes_per_block

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
        cached = prompts(1, args.prompt_tokens)[0]
        _cached(r, args, model.hf_dir(work), host, over_daemon, daemon.url, cached,
                lambda: prompts(1, args.turn_tokens)[0])
        _turn_bound(r, args, plain, model.layout(BLOCK).bytes_per_block * -(-args.prompt_tokens // BLOCK),
                    lambda: prompts(1, args.turn_tokens)[0])
    finally:
        for e in engines:
            e.close()
        daemon.stop()
    return r


def _speed(r: Results, args: argparse.Namespace, hf: Path, plain: LLMEngine,
           prompts: Callable[[int, int], list[list[int]]]) -> bool:
    """Prefill and decode, prefix caching off on both sides; whether vLLM scheduled asynchronously."""
    llm = vllm_instance(hf, None, prefix_caching=False)
    r["vllm_threads"] = torch.get_num_threads()  # as vLLM's worker left them (its model runs on this thread)
    ours, theirs = Ours(plain), Theirs(llm)
    long = prompts(1, args.prompt_tokens)[0]
    ttft(plain, long[:64]), vllm_ttft(llm, long[:64])  # warm-up
    for i in range(args.repeat):
        both(r, "prefill", i, partial(ttft, plain, long), partial(vllm_ttft, llm, long))
    if not args.no_profile:
        r["profile_prefill_ours"] = profiled(partial(ttft, plain, long))
        r["profile_prefill_vllm"] = profiled(partial(vllm_ttft, llm, long))
    for batch in DECODE_BATCHES:
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
            cached: list[int], new_turn: Callable[[], list[int]]) -> None:
    """The cached prefix: the engine's embedded host tier and the engine over the daemon at
    ``store``, against vLLM with kvstore's connector on that daemon (vLLM's own prefix cache
    off); then each engine's own warm prefix cache, for the prefix and for a next turn over it
    (``new_turn()``: new tokens, other ones each time); and the engine's next turn with the
    prefix in its host tier. Also the fewest prompt tokens a hit of each found in the store
    (``<row>_found``)."""
    from kvstore.integrations.vllm import counters, flush

    for e in (host, over_daemon):
        ttft(e, cached)  # computed once: on the device, and written through to the store
        assert e.block_manager.demoter is not None and e.store is not None
        e.block_manager.demoter.drain()
        e.evict_device_cache()
        if not e.store.flush(timeout=120):
            raise RuntimeError("the engine's store did not take the prefix within 120 s")

    def hit(e: LLMEngine, key: str, tail: tuple[int, ...] = ()) -> float:
        e.evict_device_cache()  # device -> its store (the blocks are there already: write-through)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        out = e.generate([cached + list(tail)], params)[0]
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
        r.setdefault("turn_host_ours", []).append(hit(host, "turn_found", tuple(new_turn())))
    r["vllm_found"] = (counters()["loaded_blocks"] - before) // args.repeat * VLLM_BLOCK
    del llm
    gc.collect()
    llm = vllm_instance(hf, None, prefix_caching=True)
    vllm_ttft(llm, cached)
    ttft(host, cached)
    for i in range(args.repeat):
        both(r, "warm", i, partial(ttft, host, cached), partial(vllm_ttft, llm, cached))
        tail = new_turn()
        both(r, "turn", i, partial(ttft, host, cached + tail), partial(vllm_ttft, llm, cached + tail))
    if not args.no_profile:
        tail = new_turn()
        r["profile_turn_ours"] = profiled(partial(ttft, host, cached + tail))
        r["profile_turn_vllm"] = profiled(partial(vllm_ttft, llm, cached + tail))
    del llm
    gc.collect()


def _turn_bound(r: Results, args: argparse.Namespace, plain: LLMEngine, prefix_bytes: int,
                new_turn: Callable[[], list[int]]) -> None:
    """The next turn's bound, timed in the same run: a copy of the prefix's bytes (a warm
    ``copy_`` between two buffers of its size) and the new tokens' prefill with no context."""
    src = torch.ones(prefix_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # both touched: no page faults in the timed copies
    for _ in range(args.repeat):
        started = time.perf_counter()
        dst.copy_(src)
        r.setdefault("copy_ours", []).append(time.perf_counter() - started)
        r.setdefault("fresh_turn_ours", []).append(ttft(plain, new_turn()))
    r["prefix_bytes"] = prefix_bytes


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
    for batch in DECODE_BATCHES:
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
    turn_ours, turn_vllm = best_s["turn_ours"], best_s["turn_vllm"]
    t = args.turn_tokens
    rows.append(_row(f"TTFT, a next turn: {t} new tokens over the cached {n}-token prefix, each engine's own warm "
                     "prefix cache", f"{turn_ours * 1e3:.1f} ms", f"{turn_vllm * 1e3:.1f} ms", turn_vllm / turn_ours,
                     None, spreads("turn")))
    behind = [f"{name} {ratio_text(ratio, 1)}x" for name, ratio in (
        ("prefill", ours_pf / theirs_pf),
        *((f"decode at batch {b}", best_rate[f"decode{b}_ours"] / best_rate[f"decode{b}_vllm"]) for b in DECODE_BATCHES))
        if ratio < 1]
    verdict = ("kvstore is behind vLLM on " + ", ".join(behind) + " (kvstore's speed over vLLM's)." if behind
               else "kvstore is not behind vLLM on prefill or decode in this run.")
    lines = [
        "## kvstore engine vs vLLM (`kvstore bench vs-vllm`)",
        "",
        f"Machine: {machine()}, vLLM {vllm.__version__} (CPU build), both in one process ({r['threads']} torch "
        f"threads; vLLM's model ran on {r['vllm_threads']}: its `uni` executor reserves no core, "
        "VLLM_CPU_NUM_OF_RESERVED_CPU binds only a multiprocess engine core's threads). "
        f"Model: {args.bench_model.describe()}, fp32 on both sides, {loaded_from(args.bench_model)}. "
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
        "",
        *_turn_table(r, args),
    ]
    if not args.no_profile:
        lines += ["", f"Where the time goes (torch profiler, all threads; one prefill, one next turn from each "
                  f"engine's warm cache, and {args.profile_steps} decode steps after the first; self CPU time of the ops in ms, per step for decode; the profiler slows "
                  "both sides):", ""]
        for what, label in (("prefill", "prefill"), ("turn", f"next turn ({args.turn_tokens} tokens over {n} cached)"),
                            *((f"decode{b}", f"decode step, batch {b}") for b in DECODE_BATCHES)):
            for side, name in (("ours", "kvstore engine"), ("vllm", "vLLM")):
                wall, ops = r[f"profile_{what}_{side}"]
                in_ops = sum(ops.values())
                top = ", ".join(f"`{op}` {ms:.1f}" for op, ms in sorted(ops.items(), key=lambda kv: -kv[1])[:TOP_OPS])
                lines.append(f"- {label}, {name}: {wall:.1f} ms, {in_ops:.1f} in torch ops ({top}), "
                             f"{wall - in_ops:.1f} outside them (Python, scheduling, sampling).")
    return "\n".join(lines)


def _turn_table(r: Results, args: argparse.Namespace) -> list[str]:
    """The engine's next turn from its host tier against its bound (``TURN_BOUND`` x the copy of
    the prefix's bytes plus the new tokens' prefill with no context), every figure the best of
    the run's repetitions."""
    n, t = args.prompt_tokens, args.turn_tokens
    turn, copy, fresh = min(r["turn_host_ours"]), min(r["copy_ours"]), min(r["fresh_turn_ours"])
    bound = TURN_BOUND * (copy + fresh)
    ratio = turn / bound
    spread = " / ".join(f"{_spread(r[k]):.0%}" for k in ("turn_host_ours", "copy_ours", "fresh_turn_ours"))
    return [
        f"The engine alone, a next turn from its host tier: the {n}-token prefix in host RAM (every hit found "
        f"at least {r['turn_found']} of its tokens there), {t} new tokens, against {TURN_BOUND:g} x (a `copy_` of "
        f"the prefix's {r['prefix_bytes'] / 2**20:.1f} MiB of KV between two warm buffers + the same number of "
        f"new tokens' prefill with no context), all in this run, best of {args.repeat} each:",
        "",
        "| measurement | kvstore engine | bound | TTFT / bound | target | met | spread (turn / copy / prefill) |",
        "|---|---|---|---|---|---|---|",
        f"| TTFT, a next turn: {t} new tokens over the {n}-token prefix in host RAM | {turn * 1e3:.1f} ms "
        f"| {bound * 1e3:.1f} ms = {TURN_BOUND:g} x ({copy * 1e3:.1f} + {fresh * 1e3:.1f}) | {ratio:.2f} | <= 1 "
        f"| {'yes' if ratio <= 1 else 'NO'} | {spread} |",
    ]


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
    p = targets.add_parser("vs-vllm", help="the kvstore engine vs vLLM: prefill, decode, cached-prefix and next-turn "
                           "TTFT (SmolLM2; needs vLLM)")
    add_model_arguments(p)
    p.add_argument("--prompt-tokens", type=positive(int), default=2048,
                   help="prefill and cached-prefix prompt length (default 2048)")
    p.add_argument("--decode-prompt", type=positive(int), default=128, help="prompt length of the decode runs (default 128)")
    p.add_argument("--decode-tokens", type=positive(int), default=32, help="decode steps measured (default 32)")
    p.add_argument("--turn-tokens", type=positive(int), default=16,
                   help="new tokens of a next turn over the cached prefix (default 16)")
    p.add_argument("--repeat", type=positive(int), default=5, help="repetitions of each side; the best is kept (default 5)")
    p.add_argument("--profile-steps", type=positive(int), default=4,
                   help="decode steps profiled per side and batch (default 4)")
    p.add_argument("--no-profile", action="store_true", help="leave out the profiles of prefill and decode")
    p.add_argument("--dir", help="where the scratch daemon data goes (default: current directory)")
    add_output_arguments(p)
    p.set_defaults(func=run)
