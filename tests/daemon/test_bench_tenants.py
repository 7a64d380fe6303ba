"""``kvstore bench tenants`` end to end at tiny sizes: real daemon processes, the real engine
on a 2-layer random Llama, a flooding tenant; nothing written to docs/benchmarks.md."""

from __future__ import annotations

import re
import subprocess
import sys

from daemon_helpers import ROOT


def test_bench_tenants_end_to_end_tiny() -> None:
    doc = ROOT / "docs" / "benchmarks.md"
    before = doc.read_text() if doc.exists() else None
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "bench", "tenants", "--tiny", "--chats", "3", "--turns", "3",
         "--system-tokens", "64", "--user-tokens", "48", "--reply-tokens", "16", "--flood-ratio", "4",
         "--flood-tokens", "512", "--host-mem", "1MiB", "--device-blocks", "20", "--rounds", "1", "--no-write"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in re.finditer(
        r"^\| (B[^|]*?) \| ([0-9.]+) \| [0-9.]+% \| ([0-9.]+) \|", proc.stdout, re.M)}
    alone, quotas, free = rows["B alone"], rows["B + A, equal soft quotas"], rows["B + A, no quotas"]
    assert alone[1] > 0.2, proc.stdout  # the daemon serves B's returning chats
    assert quotas[0] >= 0.9 * alone[0] and "met" in proc.stdout and "NOT met" not in proc.stdout
    assert free[1] < 0.5 * alone[1], proc.stdout  # without quotas the flood takes B's blocks
    assert (doc.read_text() if doc.exists() else None) == before
