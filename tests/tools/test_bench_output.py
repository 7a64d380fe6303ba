"""Where ``kvstore bench`` puts its results: stdout always, a file only where ``--write`` says
(its plot beside it), and scripts/update_benchmarks.py, which updates a benchmarks page from
such a run. A missing ``kvstore[bench]`` extra is one line, said before anything is measured.

``kvstore bench route`` on a small synthetic trace stands for every target: it is the one
that draws a plot and runs in a second or two."""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.tools.bench import extras
from kvstore.tools.bench.output import read_sections
from kvstore.tools.replay.workloads import write_trace

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "benchmarks.md"
SCRIPT = ROOT / "scripts" / "update_benchmarks.py"
SMALL = ["--capacity", "20,40", "--index-blocks", "3000", "--rounds", "20", "--repeat", "1"]
HEADING = "## Cache-aware routing (`kvstore bench route`)"
PNG = b"\x89PNG\r\n\x1a\n"
NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None\nfrom kvstore.cli import main\nsys.exit(main(sys.argv[1:]))"


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    write_trace("zipf", path, num_requests=300)
    return path


def route(trace: Path, *flags: str) -> list[str]:
    return ["bench", "route", "--trace", str(trace), *SMALL, *flags]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def run(cmd: list[str | Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_a_bench_prints_its_section_and_writes_nothing_by_default(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    before, listing = digest(DOCS), files(tmp_path)
    assert main(route(trace)) == 0
    out = capsys.readouterr().out
    assert HEADING in out and "| 40 | cache_aware |" in out and "Decision time" in out
    assert "wrote" not in out and "![" not in out  # no file, no plot, no link to one
    assert files(tmp_path) == listing
    assert digest(DOCS) == before


def test_write_puts_the_section_it_printed_at_path_and_the_plot_beside_it(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "out" / "page.md"
    before = digest(DOCS)
    assert main(route(trace, "--write", str(page))) == 0
    printed = capsys.readouterr().out
    doc = page.read_text()
    assert doc.startswith(f"# Benchmarks\n\n<!-- bench:route:start -->\n{HEADING}\n")
    assert doc.endswith("<!-- bench:route:end -->\n")
    sections = read_sections(doc)
    assert list(sections) == ["route"]
    assert sections["route"].endswith("\n\n![cached fraction and load spread](img/bench_route.png)")
    assert sections["route"] in printed  # the file holds what was printed
    assert (tmp_path / "out" / "img" / "bench_route.png").read_bytes().startswith(PNG)
    assert files(tmp_path / "out") == ["img", "img/bench_route.png", "page.md"]
    assert digest(DOCS) == before


def test_write_into_an_existing_page_replaces_its_section_and_keeps_the_rest(tmp_path: Path, trace: Path) -> None:
    page = tmp_path / "page.md"
    head = "# Results\n\nintro\n\n<!-- bench:tiers:start -->\nold tiers\n<!-- bench:tiers:end -->\n\nmiddle\n\n"
    tail = "\n\nthe end\n"
    page.write_text(f"{head}<!-- bench:route:start -->\nold route\n<!-- bench:route:end -->{tail}")
    assert main(route(trace, "--write", str(page))) == 0
    doc = page.read_text()
    assert doc.startswith(f"{head}<!-- bench:route:start -->\n{HEADING}\n")
    assert doc.endswith(f"<!-- bench:route:end -->{tail}")
    assert "old route" not in doc and read_sections(doc)["tiers"] == "old tiers"


def test_plot_alone_draws_the_plot_and_writes_no_page(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(route(trace, "--plot", "where/p.png")) == 0
    assert "![cached fraction and load spread](where/p.png)" in capsys.readouterr().out
    assert (tmp_path / "where" / "p.png").read_bytes().startswith(PNG)
    assert files(tmp_path) == ["trace.jsonl", "where", "where/p.png"]


def test_the_old_no_write_flag_warns_once_and_writes_nothing(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    before = digest(DOCS)
    assert main(route(trace, "--no-write")) == 0
    out, err = capsys.readouterr()
    assert HEADING in out
    assert err.splitlines() == ["kvstore bench: --no-write is the default now (results print; --write PATH writes "
                                "them too); the old flag still works"]
    assert files(tmp_path) == ["trace.jsonl"] and digest(DOCS) == before


def test_a_plot_without_matplotlib_is_one_line_before_anything_is_measured(tmp_path: Path, trace: Path) -> None:
    page = tmp_path / "page.md"
    proc = run([sys.executable, "-c", NO_MATPLOTLIB, *route(trace, "--write", str(page))], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "kvstore bench route: drawing bench_route.png needs matplotlib: pip install 'kvstore[bench]'"]
    assert proc.stdout == "" and not page.exists()  # refused before the replay and the timing


def test_a_missing_extra_raised_mid_run_is_still_one_line(tmp_path: Path, trace: Path) -> None:
    """The dispatcher's net under the up-front check: a plot that finds matplotlib gone when it
    draws ends the command with one line, not a traceback."""
    code = ("import sys\nfrom kvstore.tools.bench import output\noutput.check_plot = lambda *a: True\n"
            "sys.modules['matplotlib'] = None\nfrom kvstore.cli import main\nsys.exit(main(sys.argv[1:]))")
    proc = run([sys.executable, "-c", code, *route(trace, "--plot", str(tmp_path / "p.png"))], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "kvstore bench route: kvstore bench route's plot needs matplotlib: pip install 'kvstore[bench]'"]


def test_replay_names_the_extra_for_its_plot_and_shows_progress_without_tqdm(tmp_path: Path, trace: Path) -> None:
    blocked = NO_MATPLOTLIB.replace("= None\n", "= None; sys.modules['tqdm'] = None\n", 1)
    proc = run([sys.executable, "-c", blocked, "replay", trace, "--capacity", "20,40", "--plot", "r.png"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["kvstore replay: error: --plot needs matplotlib: pip install 'kvstore[bench]'"]
    proc = run([sys.executable, "-c", blocked, "replay", trace, "--capacity", "20,40"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "belady" in proc.stdout and "Traceback" not in proc.stderr


def test_progress_is_plain_lines_without_tqdm(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                              ) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(extras, "PLAIN_EVERY_S", 0.0)
    assert not extras.available("tqdm")
    with extras.progress_bar(10_000, "req") as bar:
        bar.update(4_000)
        bar.update(6_000)
    assert capsys.readouterr().err.splitlines() == ["4,000 of 10,000 req", "10,000 of 10,000 req"]
    with extras.progress_bar(10, "req", disable=True) as bar:
        bar.update(10)
    assert capsys.readouterr().err == ""


def test_update_benchmarks_replaces_the_matching_section_and_brings_the_plot(tmp_path: Path, trace: Path) -> None:
    page = tmp_path / "docs" / "benchmarks.md"
    page.parent.mkdir()
    other = "<!-- bench:tiers:start -->\nold tiers\n<!-- bench:tiers:end -->"
    page.write_text(f"# B\n\n{other}\n\n<!-- bench:route:start -->\nold route\n<!-- bench:route:end -->\n\nend\n")
    before = digest(DOCS)
    proc = run([sys.executable, SCRIPT, "--docs", page, *route(trace)[1:]], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = page.read_text()
    assert doc.startswith(f"# B\n\n{other}\n\n<!-- bench:route:start -->\n{HEADING}\n")
    assert doc.endswith("\n\n![cached fraction and load spread](img/bench_route.png)\n<!-- bench:route:end -->\n\nend\n")
    assert (page.parent / "img" / "bench_route.png").read_bytes().startswith(PNG)
    assert files(page.parent) == ["benchmarks.md", "img", "img/bench_route.png"]
    assert files(tmp_path) == ["docs", "docs/benchmarks.md", "docs/img", "docs/img/bench_route.png", "trace.jsonl"]
    assert digest(DOCS) == before  # the page it was given, not the repository's


def test_update_benchmarks_changes_nothing_unless_the_bench_ran_and_its_section_has_a_place(
        tmp_path: Path, trace: Path) -> None:
    page = tmp_path / "benchmarks.md"
    original = "# B\n\n<!-- bench:route-small:start -->\nold\n<!-- bench:route-small:end -->\n"
    page.write_text(original)
    proc = run([sys.executable, SCRIPT, "--docs", page, *route(trace)[1:]], tmp_path)
    assert proc.returncode == 2
    assert f"{page} has no section route: add <!-- bench:route:start --> and <!-- bench:route:end -->" in proc.stderr
    proc = run([sys.executable, SCRIPT, "--docs", page, "bench-that-is-not"], tmp_path)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr  # kvstore bench's own usage error
    proc = run([sys.executable, SCRIPT, "--docs", page, *route(trace, "--write", "x.md")[1:]], tmp_path)
    assert proc.returncode == 2 and "--write and --plot are this script's to give" in proc.stderr
    assert page.read_text() == original and files(tmp_path) == ["benchmarks.md", "trace.jsonl"]
    # --section: the bench's one section under the name the page gives it
    proc = run([sys.executable, SCRIPT, "--docs", page, "--section", "route-small", *route(trace)[1:]], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_sections(page.read_text())["route-small"].startswith(HEADING)


def _imports_of(module: str, tree: ast.AST, in_function: bool = False) -> list[tuple[int, bool]]:
    """(line, inside a function) of each import of ``module`` (or a submodule) in ``tree``."""
    found = []
    for node in ast.iter_child_nodes(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(name.split(".")[0] == module for name in names):
            found.append((node.lineno, in_function))
        found += _imports_of(module, node, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return found


def test_matplotlib_and_tqdm_are_imported_only_inside_the_extras_functions() -> None:
    """Neither is a dependency of ``pip install kvstore``: no module imports either at its top,
    and only tools.bench.extras imports them at all, so that every use of them says how to
    install them."""
    seen: dict[str, list[str]] = {"matplotlib": [], "tqdm": []}
    for path in sorted((ROOT / "kvstore").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for module, where in seen.items():
            where += [f"{path.relative_to(ROOT)}:{line}{'' if inside else ' (at the top)'}"
                      for line, inside in _imports_of(module, tree)]
    for module, where in seen.items():
        assert where, f"tools.bench.extras imports {module} no more"
        assert all(w.startswith("kvstore/tools/bench/extras.py:") and "top" not in w for w in where), where


def test_every_command_registers_without_loading_matplotlib() -> None:
    code = "import sys\nfrom kvstore.cli import build_parser\nbuild_parser()\nprint('matplotlib' in sys.modules)"
    proc = run([sys.executable, "-c", code], ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]
