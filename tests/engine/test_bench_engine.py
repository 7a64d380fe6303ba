"""``kvstore bench engine`` runs end to end at small sizes, exactly as a user runs it (a real
process: engines, transformers, a served ``kvstore engine``), and its table says what it
measured: the sizes asked for, and ratios that are the quotient of the times it prints."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

from kvstore.tools.bench.redis_local import need_binaries

from factories import require

ROOT = Path(__file__).resolve().parents[2]


def _ms(cell: str) -> float:
    return float(re.search(r"([0-9.]+) ms", cell).group(1))  # type: ignore[union-attr]


def test_a_small_run_prints_every_row_and_writes_nothing(tmp_path: Path) -> None:
    missing = need_binaries()  # the remote row's local Redis Cluster
    require(missing is None, f"{missing}: the remote-hit row needs a real Redis")
    docs = ROOT / "docs" / "benchmarks.md"
    before = hashlib.sha256(docs.read_bytes()).hexdigest()
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "engine", "--prompt-tokens", "64",
                           "--decode-prompt", "8", "--decode-tokens", "2", "--repeat", "1", "--no-write", "--random-model",
                           "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hashlib.sha256(docs.read_bytes()).hexdigest() == before  # --no-write
    rows = {cells[1].strip(): [c.strip() for c in cells[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("| ") and (cells := line.split("|"))}
    assert "best of 1 (3 for each host-hit row; 3 for the recompute, timed between the hits)" in proc.stdout
    # a 64-token prompt is 5 blocks with its first token's: the full pool's admission evicts 4
    full = "TTFT, prefix in host tier, device pool full (admission evicts 4 blocks)"
    back = 'same, `device_write_policy="write_back"` (admission gathers the victims)'
    remote = "TTFT, prefix only in the remote tier (a fresh engine, local Redis Cluster)"
    for name in ("TTFT, prefix in host tier", full, back, "TTFT, prefix on disk, page cache dropped", remote):
        ours, baseline, ratio = rows[name][0], rows[name][1], rows[name][2]
        assert baseline.startswith("full recompute")
        expected = _ms(baseline) / _ms(ours)
        got = float(re.match(r"([0-9.]+)x faster", ratio).group(1))  # type: ignore[union-attr]
        assert abs(got - expected) <= 0.02 * expected + 0.05, (name, ours, baseline, ratio)
    assert "prefill, 64-token prompt (TTFT of a miss)" in rows
    assert "served: TTFT over HTTP, 64-token prefix on device" in rows
    assert {"decode, batch 1", "decode, batch 16"} <= rows.keys()
    stages = [line for line in proc.stdout.splitlines() if line.startswith(("| host hit", "| disk hit", "| remote hit"))]
    assert len(stages) == 6
    for line in stages:  # each row's stages add up to no more than its total
        cells = [float(c) for c in line.split("|")[2:-1]]
        assert sum(cells[:-1]) <= cells[-1] + 0.1 * len(cells), line
