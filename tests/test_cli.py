"""The ``kvstore`` command: every subcommand registers and the store demo runs end to end."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli import build_parser, main
from kvstore.engine.checkpoint import SMOLLM2_FILE, SMOLLM2_INSTALL, smollm2_gguf

from factories import require


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


def test_engine_demo_with_its_defaults_is_a_real_chat_served_from_every_tier(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `kvstore demo` exactly as the README runs it (only the data directory moved): SmolLM2 answers
    require(smollm2_gguf(), f"{SMOLLM2_FILE} is not installed ({SMOLLM2_INSTALL})")
    assert main(["demo", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "restart" in out and out.count("\n[turn ") == 12  # 3 users x 4 turns
    first_answer = out.split("  A: ", 1)[1].split("\n", 1)[0]
    assert "Paris" in first_answer, first_answer  # "What is the capital of France?"
    totals = next(line for line in out.splitlines() if line.startswith("prompt tokens:"))
    host, disk = (int(totals.split(f"{tier} ")[1].split(",")[0]) for tier in ("host", "disk"))
    assert host > 0 and disk > 0, totals  # prefixes came back from both lower tiers
    assert "with a cached prefix, TTFT" in totals and "faster than recomputing" in totals


def test_engine_demo_on_the_random_model_runs_to_its_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--random-model", "--data-dir", str(tmp_path), "--users", "2", "--turns", "2",
                 "--reply-tokens", "4", "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "the random model" in out and out.count("\n[turn ") == 4 and "tier occupancy:" in out
    assert "recomputing" not in out  # --no-compare


def test_engine_demo_refuses_a_device_pool_too_small_up_front(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--random-model", "--data-dir", str(tmp_path), "--device-blocks", "48"]) == 2
    err = capsys.readouterr().err
    assert "--device-blocks 48 is too small" in err and "blocks of 16 tokens" in err
    assert not (tmp_path / "engine-demo").exists()  # refused before anything was created


def test_engine_demo_names_a_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--model", str(tmp_path / "nowhere.gguf"), "--data-dir", str(tmp_path)]) == 2
    assert "nowhere.gguf does not exist" in capsys.readouterr().err


def _bench_targets() -> dict[str, argparse.ArgumentParser]:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bench = commands.choices["bench"]
    targets = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    return dict(targets.choices)


def test_every_benchmark_refuses_a_repeat_count_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    targets = _bench_targets()
    assert {"tiers", "engine", "daemon", "remote", "codecs", "events", "route", "route-live"} <= set(targets)
    checked = 0
    for name, target in targets.items():
        repeat = next((a for a in target._actions if "--repeat" in a.option_strings), None)
        if repeat is None:
            continue
        for bad in ("0", "-3", "two"):
            with pytest.raises(SystemExit) as exit_info:
                build_parser().parse_args(["bench", name, "--repeat", bad])
            assert exit_info.value.code == 2
            assert f"argument --repeat: must be a positive int, got '{bad}'" in capsys.readouterr().err, name
        assert repeat.type is not None and repeat.type("2") == 2, name
        checked += 1
    assert checked >= 8
