"""scripts/daemon_kill_loop.py for 10 cycles: kill -9 of a real daemon under an engine's and three
clients' load, then a restart; nothing wrong is ever read and no acknowledged block is lost."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "daemon_kill_loop.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("daemon_kill_loop", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_ten_kill9_cycles_under_load_lose_no_acknowledged_block_and_read_nothing_wrong(tmp_path: Path) -> None:
    loop = load_script()
    report = loop.run_loop(10, seed=47, data_dir=tmp_path / "kill-loop")
    print(report.summary())
    assert not report.errors, report.errors[:5]
    assert (report.wrong, report.lost) == (0, 0), report.summary()
    assert report.ok
    cycles = report.cycles
    assert len(cycles) == 10
    # the load really ran: puts acknowledged before most kills, reads checked in every cycle
    assert sum(c.puts_acked > 0 for c in cycles) >= 8, [c.puts_acked for c in cycles]
    assert all(c.blocks_verified > 0 and c.engine_prompts > 0 for c in cycles)
    # after each restart the engine's fresh device pool is empty: it reads its prefixes from the daemon
    assert sum(c.engine_hit_tokens > 0 for c in cycles[1:]) >= 8, [c.engine_hit_tokens for c in cycles]
    assert report.total("engine_blocks_verified") > 0
    # the last read covered every acknowledged block, and found each one exact
    assert report.final.blocks_verified == report.total("puts_acked") * loop.CHAIN > 0
