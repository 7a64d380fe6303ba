"""The benchmark tables: a ratio is never rounded into a target it missed."""

from __future__ import annotations

from kvstore.tools.bench.harness import Row, ratio_text, render


def _line(rows: list[Row], name: str) -> str:
    return next(line for line in render(rows, "here").splitlines() if line.startswith(f"| {name} |"))


def test_a_ratio_just_under_its_target_shows_three_decimals_and_no() -> None:
    rows = [
        Row("near miss", 1.0, 0.897, "copy", ">= 0.9x"),
        Row("met", 1.0, 0.95, "copy", ">= 0.9x"),
        Row("exactly", 1.0, 0.9, "copy", ">= 0.9x"),
        Row("fast", 1.0, 1.996, "recipe", ">= 2x", ratio_kind="speedup"),
        Row("p99", 0.004, 0.0108, "locked", ">= 2x", ratio_kind="lower"),
        Row("p99 near", 0.005, 0.00999, "locked", ">= 2x", ratio_kind="lower"),
    ]
    assert "| 0.897x | >= 0.9x | NO |" in _line(rows, "near miss")
    assert "| 0.95x | >= 0.9x | yes |" in _line(rows, "met")
    assert "| 0.90x | >= 0.9x | yes |" in _line(rows, "exactly")
    assert "| 1.996x faster | >= 2x | NO |" in _line(rows, "fast")
    assert "| 2.70x lower | >= 2x | yes |" in _line(rows, "p99")
    assert "| 1.998x lower | >= 2x | NO |" in _line(rows, "p99 near")


def test_ratio_text_keeps_two_decimals_unless_rounding_would_meet_the_target() -> None:
    assert ratio_text(0.8951, 0.9) == "0.895"
    assert ratio_text(0.8949, 0.9) == "0.89"  # rounds down: the miss shows as it is
    assert ratio_text(1.4999, 1.5) == "1.4999"
    assert ratio_text(0.9, 0.9) == "0.90"
    assert ratio_text(1.53, 1.5) == "1.53"
