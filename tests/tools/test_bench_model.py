"""scripts/shm_put_model.py: the shared-memory put model runs, both wakeups, and refuses bad arguments."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "shm_put_model.py"
ROW = re.compile(r"^\s*(\d+)us\s+(socket|eventfd)\s+([0-9.]+)ms\s+([0-9.]+)ms\s+([0-9.]+)x$")


def test_the_model_prints_a_row_per_work_and_wakeup_and_its_server_exits() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--runs", "2", "--work-us", "0", "50"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [ROW.match(line) for line in proc.stdout.splitlines()[1:]]
    assert all(rows), proc.stdout
    got = [(int(m[1]), m[2]) for m in rows if m]
    assert got == [(0, "socket"), (0, "eventfd"), (50, "socket"), (50, "eventfd")]
    for m in rows:
        assert m is not None
        put_ms, copy_ms, ratio = float(m[3]), float(m[4]), float(m[5])
        assert put_ms > 0 and copy_ms > 0 and abs(ratio - copy_ms / put_ms) < 0.02  # the ratio is copy over put


def test_the_model_refuses_bad_arguments() -> None:
    for args in (["--runs", "0"], ["--work-us", "-5"], ["--wake", "pipe"]):
        proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (args, proc.stdout)
        assert "error:" in proc.stderr
