"""``kvstore bench route-live`` end to end at small sizes, as a user runs it: real replica and
router processes, the official openai client; the table says what it measured and writes nothing
with --no-write."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_small_run_prints_each_policy_and_writes_nothing() -> None:
    docs = ROOT / "docs" / "benchmarks.md"
    before = hashlib.sha256(docs.read_bytes()).hexdigest()
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "route-live", "--random-model",
                           "--replicas", "2", "--conversations", "2", "--turns", "2", "--max-tokens", "2",
                           "--repeat", "1", "--kv-cache", "16MiB", "--no-write"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert hashlib.sha256(docs.read_bytes()).hexdigest() == before  # --no-write
    assert "2 `kvstore engine` replicas of random weights (4 layers" in proc.stdout
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("| 1 |")]
    aware, rr = (re.match(r" ([0-9]+) / ([0-9]+) ms ", c).groups() for c in row.split("|")[2:4])  # type: ignore[union-attr]
    ratio = float(re.search(r"([0-9.]+)x lower", row).group(1))  # type: ignore[union-attr]
    # the ratio is the quotient of the two mean TTFTs, which the row rounds to whole milliseconds
    low, high = (int(rr[0]) - 0.5) / (int(aware[0]) + 0.5), (int(rr[0]) + 0.5) / max(int(aware[0]) - 0.5, 1e-9)
    assert low - 0.005 <= ratio <= high + 0.005, row
