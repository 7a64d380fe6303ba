"""What ``pip install kvstore`` ships and pulls in, with no extra: no test fixtures, neither
matplotlib nor tqdm (the ``bench`` extra has both; tqdm also comes with the ``model`` extra's
tokenizers), and a command line that still starts. The vLLM connector's users install kvstore
this way."""

from __future__ import annotations

import json
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from wheel_venv import InstalledWheel, clean_env, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first test pays for the build and install

BENCH_ONLY = ("matplotlib", "tqdm")
FIXTURES = re.compile(r"(^|/)(tests?|testing)/|(^|/)(conftest|test_[^/]*)\.py$")
PROBE = """
import importlib.util, json, sys
import kvstore
from kvstore.cli import build_parser
build_parser()  # every command registered: every bench module imported
print(json.dumps({
    "found": {m: importlib.util.find_spec(m) is not None for m in ("matplotlib", "tqdm")},
    "loaded": sorted(m for m in sys.modules if m.split(".")[0] == "matplotlib"),
}))
"""


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def _requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        (metadata,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        text = zf.read(metadata).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def _name(requirement: str) -> str:
    """The normalized project name a requirement (or a name in pip's lists) starts with."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement.strip()).group(0).lower())  # type: ignore[union-attr]


def test_the_wheel_ships_no_test_fixtures(wheel: Path) -> None:
    names = _names(wheel)
    assert "kvstore/__init__.py" in names
    assert not [n for n in names if n.startswith("kvstore/tools/testing/")], "the old fixtures' package is back"
    assert not [n for n in names if n.startswith("tests/") or FIXTURES.search(n)]


def test_the_wheel_requires_neither_matplotlib_nor_tqdm_and_its_bench_extra_has_both(wheel: Path) -> None:
    requirements = _requirements(wheel)
    plain = {_name(r) for r in requirements if "extra ==" not in r}
    bench = {_name(r) for r in requirements if re.search(r"""extra\s*==\s*["']bench["']""", r)}
    assert plain and not plain & set(BENCH_ONLY), sorted(plain)
    assert bench == {*BENCH_ONLY, "hiredis"}, requirements  # hiredis: redis-py at its fastest, bench remote's baseline


def test_a_bare_install_has_neither_matplotlib_nor_tqdm(bare: InstalledWheel) -> None:
    found = json.loads(bare.python_c(PROBE).splitlines()[-1])
    assert found == {"found": {"matplotlib": False, "tqdm": False}, "loaded": []}


def test_the_bare_command_line_starts_and_names_the_extra_a_plot_needs(bare: InstalledWheel) -> None:
    out = run([bare.bin("kvstore"), "--help"], cwd=bare.outside, timeout=120).stdout
    assert all(command in out for command in ("bench", "replay", "serve", "engine"))
    run([bare.bin("kvstore"), "bench", "engine", "--help"], cwd=bare.outside, timeout=120)
    proc = subprocess.run([str(bare.bin("kvstore")), "bench", "route", "--trace", "absent.jsonl", "--plot", "p.png"],
                          cwd=bare.outside, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "kvstore bench route: drawing bench_route.png needs matplotlib: pip install 'kvstore[bench]'"]
