"""The ``kvstore`` command: every subcommand registers and the store demo runs end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli import build_parser, main


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "bench", "replay", "serve"):
        assert command in out
    bench = build_parser().parse_args(["bench", "tiers", "--no-write"])
    assert bench.target == "tiers"
    for target in ("engine", "daemon"):
        assert build_parser().parse_args(["bench", target]).target == target


def test_unknown_command_is_a_usage_error() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "frobnicate"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def test_store_demo_moves_blocks_between_tiers_and_survives_restart(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--store-only", "--data-dir", str(tmp_path), "--users", "3", "--turns", "4",
                 "--host-blocks", "8", "--disk-blocks", "256"])
    assert code == 0
    out = capsys.readouterr().out
    assert "restart" in out
    served = next(line for line in out.splitlines() if line.startswith("blocks served from host"))
    host, disk = [int(w) for w in served.replace(",", "").split() if w.isdigit()][:2]
    assert host > 0 and disk > 0, served  # a small host tier: prefixes came back from both tiers


def test_demo_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--store-only", "--users", "0"]) == 2
    assert "--users must be >= 1" in capsys.readouterr().err
