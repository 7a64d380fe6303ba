"""``kvstore bench hybrid`` runs end to end at small sizes as a user runs it (a real process,
engines, a disk tier, a local Redis Cluster), and its table says what it measured: the bytes a
hit moves are the KV-group arithmetic, and each ratio is the quotient of the times it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kvstore.engine.checkpoint import random_checkpoint, save_random_checkpoint
from kvstore.tools.bench.redis_local import need_binaries

from factories import require

ROOT = Path(__file__).resolve().parents[2]


def _ms(cell: str) -> float:
    return float(re.match(r"([0-9.]+) ms", cell).group(1))  # type: ignore[union-attr]


def bench(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "hybrid", *args], capture_output=True,
                          text=True, timeout=600, cwd=cwd)


def test_a_small_run_measures_both_layouts_in_every_tier(tmp_path: Path) -> None:
    missing = need_binaries()
    require(missing is None, f"{missing}: the remote rows need a real Redis")
    proc = bench("--random-model", "--prompt-tokens", "256", "--repeat", "1", "--dir", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {cells[2].strip(): [c.strip() for c in cells[3:-1]]
            for line in proc.stdout.splitlines() if line.startswith("| 256 ") and (cells := line.split("|"))}
    # 256 tokens = 16 blocks, all served. The random model: 10 sliding layers (W = 128 tokens, 8
    # blocks) and 2 full, as 5 sliding groups and 1 full group of 2 layer slots, a group block a
    # sixth of an all-layers block: the full group's 16 blocks and each window's 8.
    moved = rows["bytes a host hit moves (256 / 256 tokens served)"]
    assert float(moved[2].rstrip("x")) == round((16 + 5 * 8) / (6 * 16), 3)
    recompute = _ms(rows["TTFT, recompute (no cache)"][0])
    for tier in ("host", "disk", "remote"):
        groups, full, ratio = rows[f"TTFT, prefix in {tier}"][:3]
        got = re.match(r"groups ([0-9.]+)x faster than recompute; all-full / groups ([0-9.]+)", ratio)
        assert got is not None, ratio
        assert abs(float(got[1]) - recompute / _ms(groups)) <= 0.02 * recompute / _ms(groups) + 0.05, ratio
        assert abs(float(got[2]) - _ms(full) / _ms(groups)) <= 0.02 * _ms(full) / _ms(groups) + 0.01, ratio
    assert not list(tmp_path.glob("kvstore-bench-hybrid-*"))  # the scratch tiers are gone


def test_a_model_without_sliding_window_layers_is_one_line(tmp_path: Path) -> None:
    save_random_checkpoint(tmp_path / "llama", random_checkpoint(dict(num_layers=2, hidden_size=64, num_heads=2,
                                                                      num_kv_heads=1, head_dim=32)))
    proc = bench("--model", str(tmp_path / "llama"), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "has no sliding-window layer" in proc.stderr, proc.stderr


def test_bad_prompt_lengths_are_refused_by_argparse(tmp_path: Path) -> None:
    proc = bench("--random-model", "--prompt-tokens", "4096,x", cwd=tmp_path)
    assert proc.returncode == 2 and "expected token counts separated by commas" in proc.stderr
