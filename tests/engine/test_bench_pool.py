"""``kvstore bench pool`` end to end at small sizes, as a user runs it (a real process, the
random model, one repetition, --no-write): every row is there, capacities follow from the page
sizes, each ratio is the quotient of the figures its row prints, and docs/ is left alone."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_small_run_prints_every_row_and_writes_nothing(tmp_path: Path) -> None:
    docs = ROOT / "docs" / "benchmarks.md"
    before = hashlib.sha256(docs.read_bytes()).hexdigest()
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "pool", "--random-model", "--kv-cache", "8MiB",
                           "--conversation", "64", "--decode-tokens", "4", "--prompt-tokens", "64",
                           "--disk-codecs", "int8,int4-rot", "--repeat", "1", "--no-write", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hashlib.sha256(docs.read_bytes()).hexdigest() == before  # --no-write
    assert not list(tmp_path.iterdir()), "the scratch directories were left behind"
    rows = {cells[1].strip(): [c.strip() for c in cells[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("| ") and (cells := line.split("|"))}
    for fmt in ("int8", "fp8"):
        # 66 bytes a head row instead of 128: 1.94x the blocks of float16 (the random model's 24 layers)
        per_gib = rows[f"blocks per GiB, {fmt} pool"]
        ours, theirs = int(per_gib[0].replace(",", "")), int(per_gib[1].split()[-1].replace(",", ""))
        assert per_gib[2] == f"{ours / theirs:.2f}x" == "1.94x" and per_gib[4] == "yes", per_gib
        batch = rows[f"64-token conversations in 8MiB, {fmt} pool"]
        assert int(batch[0]) > int(batch[1].split()[-1]) > 0, batch  # more conversations fit
        for name in (f"that whole batch end to end, cold prompts (prefill included), {fmt} pool",
                     f"decode throughput of that whole batch, prompts cached, {fmt} pool"):
            cells = rows[name]
            a = float(cells[0].split()[0])
            b = float(re.search(r": ([0-9.]+) tok/s", cells[1]).group(1))  # type: ignore[union-attr]
            assert abs(a / b - float(cells[2].rstrip("x"))) < 0.02 * a / b + 0.011, cells
    for batch in (1, 16):
        cells = rows[f"decode, batch {batch}, int8 pool"]
        a, b = float(cells[0].split()[0]), float(cells[1].split()[-2])
        assert abs(a / b - float(cells[2].rstrip("x"))) < 0.02 * a / b + 0.011, cells
        assert cells[3] == ">= 0.9x" and cells[4] in ("yes", "NO")
    for codec in ("int8", "int4-rot"):
        cells = rows[f"TTFT, 64-token prefix from a cold disk, stored {codec}"]
        assert cells[0].endswith(" ms") and cells[1].startswith("stored raw "), cells
    # the cached-prompt decode found the prompts in the pool's prefix cache (all but each one's last token)
    found = re.search(r"found: float16 (\d+)%, int8 (\d+)%, fp8 (\d+)%", proc.stdout)
    assert found is not None and all(int(x) >= 90 for x in found.groups()), proc.stdout[-2000:]
