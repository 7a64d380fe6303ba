"""``kvstore bench engine``: TTFT with a cached prefix in each tier (host, disk, remote) vs full
recompute, prefill and decode vs transformers, and fetch time vs the tiers' measured bandwidth.

All measured in one run on one machine, on SmolLM2-135M-Instruct by default (``--model`` names
another checkpoint, ``--random-model`` a 24-layer Llama with seeded random weights), fp32 on the
CPU (or the GPU with --device cuda).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvstore.engine.checkpoint import CheckpointError
from kvstore.engine.llm import LLMEngine
from kvstore.engine.sampling import SamplingParams
from kvstore.services.common.argtypes import positive
from kvstore.tools.bench import engine_server as served
from kvstore.tools.bench.engine_report import BLOCK, HIT_SAMPLES, PLOT, plot, render
from kvstore.tools.bench.harness import DOCS, drop_page_cache, machine, scratch_dir
from kvstore.tools.bench.models import BenchModel, add_model_arguments
from kvstore.tools.bench.output import add_output_arguments, check_plot, image_line, plot_path, publish

FULL_POOL_EVICTIONS = 32  # blocks the full-pool host hit's admission evicts


def prompt_blocks(args: argparse.Namespace) -> int:
    """Device blocks the TTFT prompt takes with its first generated token."""
    return -(-(args.prompt_tokens + 1) // BLOCK)


def pool_bytes(args: argparse.Namespace) -> int:
    """A device pool sized to the workload: the TTFT prompt, or 16 decode sequences, plus a
    block per sequence of slack. An oversized pool only costs: on the CPU, with a 1 GiB pool we
    measured attention calls of the same shapes running up to ~100x slower (cause not pinned
    down; memory placement is the suspect)."""
    decode_blocks = 16 * -(-(args.decode_prompt + args.decode_tokens + 2) // BLOCK)
    return (max(prompt_blocks(args), decode_blocks) + 16) * args.bench_model.layout(BLOCK).bytes_per_block


def engine(args: argparse.Namespace, **kwargs: Any) -> LLMEngine:
    opts: dict[str, Any] = dict(device=args.device, dtype=torch.float32, block_size=BLOCK,
                                kv_cache_bytes=pool_bytes(args), max_num_batched_tokens=4096, fetch_policy="auto")
    opts.update(kwargs)
    return args.bench_model.engine(**opts)


def random_prompt(args: argparse.Namespace, num_tokens: int, seed: int) -> list[int]:
    vocab = args.bench_model.vocab_size
    return torch.randint(0, vocab, (num_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def ttft(llm: LLMEngine, prompt: list[int]) -> tuple[float, Any]:
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
    return out.metrics.ttft_s or 0.0, out.metrics


Sample = tuple[float, Any]  # (TTFT seconds, the request's metrics)


def bench_ttft(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    prompt = random_prompt(args, args.prompt_tokens, 1)
    r: dict[str, Any] = {}
    # The recompute baseline is timed in every repetition, between the hits: a noisy spell of
    # this shared machine then slows both sides of the ratio, not one.
    baseline = engine(args, enable_prefix_caching=False, host_bytes=0)
    ttft(baseline, prompt[:64])  # warm-up
    recompute = []
    disk = workdir / "kv"
    llm = engine(args, host_bytes=1 << 30, disk_path=disk, disk_bytes=1 << 30)  # write-through, the default
    # the same full-pool hit with write-back, where admission gathers the victims' bytes
    back = engine(args, host_bytes=1 << 30, device_write_policy="write_back")
    for e in (llm, back):
        ttft(e, prompt)  # compute once: the prefix is now cached on the device
    host: list[Sample] = []
    short: list[Sample] = []
    full: dict[str, list[Sample]] = {"write_through": [], "write_back": []}
    pool_blocks = llm.pool.num_blocks
    # the filler (and its first token's block) must fit the pool: a short prompt evicts fewer
    r["full_evictions"] = evictions = min(FULL_POOL_EVICTIONS, prompt_blocks(args) - 1)
    filler_blocks = pool_blocks - prompt_blocks(args) + evictions
    for i in range(args.repeat):
        recompute.append(ttft(baseline, prompt)[0])
        for j in range(HIT_SAMPLES):
            llm.evict_device_cache()  # device -> host
            host.append(ttft(llm, prompt))
            # One token short of whole blocks, the worst case: the last partial block (15
            # tokens) is computed over the same cached prefix, where a whole prompt computes one.
            llm.evict_device_cache()
            short.append(ttft(llm, prompt[:-1]))
            # Again, right after a new prompt filled the device pool: admitting this one evicts
            # `evictions` of the filler's blocks, which write-through has stored (or queued)
            # when the filler's step ended, and which write-back gathers now.
            filler = random_prompt(args, filler_blocks * BLOCK, 100 + i * HIT_SAMPLES + j)
            for policy, e in (("write_through", llm), ("write_back", back)):
                e.evict_device_cache()
                ttft(e, filler)
                full[policy].append(ttft(e, prompt))
    r["host_s"], m = min(host, key=lambda x: x[0])
    r["host_tokens"], r["host_fetch_s"], r["host_stages"] = m.cached_tokens["host"], m.loading_s, m.stages
    r["short_s"], m = min(short, key=lambda x: x[0])
    r["short_stages"], r["short_computed"] = m.stages, m.num_computed_tokens
    r["full_s"], m = min(full["write_through"], key=lambda x: x[0])
    r["full_stages"] = m.stages
    r["full_back_s"], m = min(full["write_back"], key=lambda x: x[0])
    r["full_back_stages"] = m.stages
    r["bytes_per_token"] = llm.layout.bytes_per_block / BLOCK
    back.close()
    llm.close()  # host RAM written back to disk
    disk_runs = []
    for _ in range(args.repeat):
        # a fresh engine: the catalog is the truth, every block is disk-only
        llm = engine(args, host_bytes=1 << 30, disk_path=disk, disk_bytes=1 << 30)
        drop_page_cache(disk)
        seconds, m = ttft(llm, prompt)
        disk_runs.append((seconds, m))
        llm.close()
        recompute.append(ttft(baseline, prompt)[0])
    remote_runs = bench_remote(args, workdir, prompt, baseline, recompute)
    baseline.close()
    r["recompute_s"] = min(recompute)
    r["recompute_spread"], r["recompute_runs"] = spread(recompute), len(recompute)
    r["disk_s"], m = min(disk_runs, key=lambda x: x[0])
    r["disk_tokens"], r["disk_fetch_s"], r["disk_stages"] = m.cached_tokens["disk"], m.loading_s, m.stages
    r["host_spread"], r["disk_spread"] = spread([x[0] for x in host]), spread([x[0] for x in disk_runs])
    if remote_runs:
        r["remote_s"], m = min(remote_runs, key=lambda x: x[0])
        r["remote_tokens"], r["remote_fetch_s"], r["remote_stages"] = (m.cached_tokens["remote"], m.loading_s,
                                                                        m.stages)
        r["remote_spread"] = spread([x[0] for x in remote_runs])
    return r


def spread(times: list[float]) -> float:
    """(worst - best) / best of a row's runs."""
    return (max(times) - min(times)) / min(times)


def bench_remote(args: argparse.Namespace, workdir: Path, prompt: list[int], baseline: LLMEngine,
                 recompute: list[float]) -> list[Sample]:
    """TTFT of the prefix found only in a remote tier: a real local Redis Cluster (3 primaries,
    3 replicas), written by one engine ("node A"), read by a fresh engine each time ("node B",
    host tier empty, no disk). Empty when redis-server is not installed."""
    from kvstore.tools.bench.redis_local import MIB, RedisCluster, need_binaries

    missing = need_binaries()
    if missing is not None:
        print(f"remote hit: not measured ({missing})", flush=True)
        return []
    # room for the whole prefix twice on every node: hash slots need not share it out evenly, and
    # a node at its maxmemory evicts (allkeys-lru), which would cut the chain short
    per_node = max(64 * MIB, 2 * len(prompt) * int(args.bench_model.layout(BLOCK).bytes_per_block) // BLOCK)
    cluster = RedisCluster.start(workdir / "cluster", maxmemory=per_node)
    runs: list[Sample] = []
    try:
        with engine(args, host_bytes=1 << 30, remote_url=cluster.url) as node_a:
            ttft(node_a, prompt)
            assert node_a.store is not None
            if not node_a.store.flush(timeout=120):
                raise RuntimeError("the remote tier did not take the prefix within 120 s")
        for _ in range(args.repeat):
            with engine(args, host_bytes=1 << 30, remote_url=cluster.url) as node_b:
                runs.append(ttft(node_b, prompt))
            recompute.append(ttft(baseline, prompt)[0])
    finally:
        cluster.close()
    return runs


def bench_decode(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(args.bench_model.hf_dir(workdir), dtype=torch.float32)
    hf = hf.to(args.device).eval()
    llm = engine(args, enable_prefix_caching=False, host_bytes=0)
    gen = torch.Generator().manual_seed(2)
    r: dict[str, Any] = {}
    n = args.decode_tokens
    for batch in (1, 16):
        prompts = torch.randint(0, args.bench_model.vocab_size, (batch, args.decode_prompt), generator=gen)

        def ours(new: int, prompts: torch.Tensor = prompts) -> float:
            outs = llm.generate(prompts.tolist(), SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
            first = min(o.metrics.arrival_s + (o.metrics.ttft_s or 0.0) for o in outs)
            last = max(o.metrics.arrival_s + (o.metrics.latency_s or 0.0) for o in outs)
            return last - first  # from the first token to the last: new - 1 decode steps

        def theirs(new: int, prompts: torch.Tensor = prompts) -> float:
            stamps: list[float] = []

            def clock(_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                stamps.append(time.perf_counter())  # called once per forward, after its logits
                return scores

            with torch.inference_mode():
                hf.generate(prompts.to(args.device), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                            pad_token_id=0, logits_processor=[clock])
            return stamps[-1] - stamps[0]

        ours(2), theirs(2)  # warm-up
        best = {"ours": float("inf"), "hf": float("inf")}
        for _ in range(args.repeat):  # interleaved: a noisy spell hits both sides alike
            for name, fn in (("ours", ours), ("hf", theirs)):
                best[name] = min(best[name], fn(n + 1))
        for name, seconds in best.items():
            r[f"{name}_b{batch}_tps"] = batch * n / seconds
    # a whole prompt's prefill (a miss): our TTFT against transformers' forward of the prompt
    prompt = torch.randint(0, args.bench_model.vocab_size, (args.prompt_tokens,), generator=gen)

    def hf_prefill() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf(prompt[None].to(args.device), logits_to_keep=1)
        return time.perf_counter() - t0

    r["ours_prefill_s"], r["hf_prefill_s"] = float("inf"), float("inf")
    for _ in range(args.repeat):  # interleaved, as above
        r["ours_prefill_s"] = min(r["ours_prefill_s"], ttft(llm, prompt.tolist())[0])
        r["hf_prefill_s"] = min(r["hf_prefill_s"], hf_prefill())
    llm.close()
    return r


def run(args: argparse.Namespace) -> int:
    try:
        args.bench_model = BenchModel.from_args(args)
        args.bench_model.config  # noqa: B018  (a missing or unreadable model fails here, not halfway)
    except CheckpointError as exc:
        print(f"kvstore bench engine: {exc}", file=sys.stderr)
        return 2
    if not check_plot(args, PLOT, "kvstore bench engine"):
        return 2
    with scratch_dir(args.dir, "engine") as tmp:
        print(f"{args.bench_model.describe()}: TTFT of recompute, host, disk and remote hits ...", flush=True)
        t = bench_ttft(args, tmp)
        print("decode vs transformers ...", flush=True)
        d = bench_decode(args, tmp)
    print("served: TTFT over HTTP vs in process, concurrent vs sequential requests ...", flush=True)
    s = served.bench_served(args, engine, args.bench_model, BLOCK, pool_bytes(args))
    tiers_json = DOCS / "bench_tiers.json"  # what `kvstore bench tiers --write docs/benchmarks.md` measured
    tiers = json.loads(tiers_json.read_text()) if tiers_json.exists() else None
    if tiers is not None and tiers.get("machine") != machine():
        tiers = None  # another machine's bandwidth is no limit for this one's fetches
    text = render(t, d, tiers, args, s)
    image = plot_path(args, PLOT)
    if image is not None:
        plot(t, d, image)
        print(f"wrote {image}")
        text += "\n\n" + image_line(args, image, "engine benchmark")
    publish(args, "engine", text)
    return 0


def register_target(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("engine", help="engine TTFT per tier vs recompute, decode vs transformers (SmolLM2)")
    add_model_arguments(p)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--prompt-tokens", type=positive(int), default=2048, help="cached prompt length (default 2048)")
    p.add_argument("--decode-prompt", type=positive(int), default=128, help="prompt length of the decode runs (default 128)")
    p.add_argument("--decode-tokens", type=positive(int), default=32, help="decode steps measured (default 32)")
    p.add_argument("--repeat", type=positive(int), default=3, help="repetitions; the best is kept (default 3)")
    p.add_argument("--dir", help="where the scratch disk tier goes (default: current directory; not tmpfs)")
    add_output_arguments(p, plot=PLOT)
    p.set_defaults(func=run)
