"""What every ``kvstore bench`` target shares: result rows, ratios that never round a miss up, the
machine's description, timing loops, page-cache drops, scratch folders and services.

Where results go (stdout, and a file only with ``--write``) is bench.output's.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvstore.layout import KVLayout
from kvstore.tiers.disk_files import drop_page_cache as drop_page_cache  # the benches drop what they read

BENCH_LAYOUT = KVLayout(num_layers=24, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)


def _docs_dir() -> Path:
    """docs/ of the checkout kvstore runs from; elsewhere (an installed wheel) ./docs."""
    checkout = Path(__file__).resolve().parents[3] / "docs"
    return checkout if (checkout / "benchmarks.md").exists() else Path.cwd() / "docs"


# Read only: what benchmarks and kvstore replay read from the project's docs (the quality
# bench's perplexity text, the bandwidths ``kvstore bench tiers --write docs/benchmarks.md``
# measured in bench_tiers.json). Nothing writes here unless --write names it (bench.output).
DOCS = _docs_dir()


@dataclass
class Row:
    name: str
    ours_s: float
    base_s: float
    baseline: str
    target: str
    ratio_kind: str = "throughput"  # "throughput": base/ours; "speedup": as x faster; "lower": as x lower

    @property
    def ratio(self) -> float:
        return self.base_s / self.ours_s


class CacheFlush:
    """Writes a buffer of twice the last-level cache, evicting what the caches held (call it
    before a timed section, untimed).

    The write is numpy's, on this thread alone: a torch op would leave torch's OpenMP worker
    spinning on the other core for milliseconds afterwards (libgomp's spin-wait), so the
    timed call would start on a machine with one core busy, and a process it wakes (the
    daemon, redis-server) would land on the caller's core."""

    def __init__(self, nbytes: int = 64 << 20) -> None:
        self.buffer = np.zeros(nbytes, dtype=np.uint8)

    def __call__(self) -> None:
        np.add(self.buffer, 1, out=self.buffer)


def best_of(fn: Callable[[], object], repeat: int, before: Callable[[], object] | None = None) -> float:
    """The best time of ``repeat`` calls of ``fn``; ``before`` runs untimed ahead of each."""
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def interleaved(fns: list[Callable[[], object]], rounds: int) -> list[float]:
    """Best time of each function over ``rounds`` rounds that run them in turn: a noisy
    neighbour slows every side of a round alike, and the best of each is a fair floor."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], best_of(fn, 1))
    return best


def dd_seconds(args: list[str]) -> float:
    proc = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    match = re.search(r"copied, ([0-9.]+) s", proc.stderr)
    if not match:
        raise RuntimeError(f"could not parse dd output: {proc.stderr!r}")
    return float(match.group(1))


@contextmanager
def scratch_dir(where: str | None, name: str) -> Iterator[Path]:
    """A scratch directory ``kvstore-bench-NAME-*`` for one run, under ``where`` (a bench's
    ``--dir``; default the current directory, which unlike /tmp is not tmpfs: a disk tier
    measured there reads a disk), removed afterwards whatever happens."""
    base = Path(where) if where else Path.cwd()
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"kvstore-bench-{name}-", dir=base, ignore_cleanup_errors=True) as tmp:
        yield Path(tmp)


def start_service(cmd: list[str], what: str) -> tuple[subprocess.Popen[str], str]:
    """Start ``cmd`` (a kvstore service) and wait for the line of its output that says "ready";
    the process and that line. Its later output is read off on a thread, so a chatty service
    never blocks on a full pipe. RuntimeError with its output if it exits first."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout
    assert out is not None
    lines = []
    for line in out:
        lines.append(line)
        if "ready" in line:
            threading.Thread(target=_drain, args=(out,), daemon=True).start()
            return proc, line
    raise RuntimeError(f"{what} did not start (exit {proc.wait()}): {''.join(lines)[-2000:]}")


def _drain(stream: Iterable[str]) -> None:
    for _ in stream:
        pass


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()}-core {cpu}, Linux {platform.release()}, torch {torch.__version__}"


def ratio_text(ratio: float, want: float) -> str:
    """Two decimals, or as many more as it takes not to round a miss up to its target
    (0.897 against 0.9: "0.897")."""
    for digits in range(2, 7):
        text = f"{ratio:.{digits}f}"
        if ratio >= want or float(text) < want:
            break
    return text


def render(rows: list[Row], where: str) -> str:
    lines = [
        "## Tiers (`kvstore bench tiers`)",
        "",
        f"Machine: {where}. Layout: 24 layers, 2 KV heads, head dim 64, block 16, fp16 (192 KiB blocks).",
        "",
        "| measurement | kvstore | baseline | baseline time | ratio | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.ratio_kind == "budget":
            ratio, met = f"{r.ours_s * 1e3:.3f} ms", r.ours_s < r.base_s
        elif r.ratio_kind in ("speedup", "lower"):
            want = float(r.target.split()[1].rstrip("x"))
            word = "faster" if r.ratio_kind == "speedup" else "lower"
            ratio, met = f"{ratio_text(r.ratio, want)}x {word}", r.ratio >= want
        else:
            want = float(r.target.split()[1].rstrip("x"))
            ratio, met = f"{ratio_text(r.ratio, want)}x", r.ratio >= want
        lines.append(f"| {r.name} | {r.ours_s * 1e3:.2f} ms | {r.baseline} | {r.base_s * 1e3:.2f} ms "
                     f"| {ratio} | {r.target} | {'yes' if met else 'NO'} |")
    return "\n".join(lines)

