"""``python -m fuzz``: list the harnesses, write their seed corpora, run them under libFuzzer,
replay inputs through them (``make fuzz`` runs every harness; docs/reliability.md).

    python -m fuzz list
    python -m fuzz seeds [NAME ...]                   # fuzz/corpus/NAME/ from real encodings
    python -m fuzz run [NAME ...] [--seconds 20]      # all harnesses when no NAME is given
    python -m fuzz replay NAME PATH ...               # files or directories, in this process
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from fuzz.targets import TARGETS, load

ROOT = Path(__file__).resolve().parent
CORPUS = ROOT / "corpus"
REGRESSIONS = ROOT / "regressions"
ARTIFACT_PREFIXES = ("crash-", "timeout-", "oom-", "leak-", "slow-unit-")
_STATUS = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/")
_STAT = re.compile(r"^stat::(\w+):\s+(\d+)")


@dataclass
class RunResult:
    """What one harness's run reached, from libFuzzer's own output."""

    name: str
    seconds: float
    executions: int = 0
    exec_per_s: int = 0
    coverage: int = 0  # libFuzzer's "cov": instrumented edges of kvstore's code reached
    features: int = 0
    corpus: int = 0
    peak_rss_mb: int = 0  # libFuzzer's peak: on Linux it starts from the launching process's (fuzz/engine.py)
    returncode: int = 0
    artifacts: tuple[str, ...] = ()
    log: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.artifacts

    def line(self) -> str:
        verdict = "ok" if self.ok else f"FAILED (exit {self.returncode}; {', '.join(self.artifacts) or 'no input kept'})"
        return (f"{self.name:<16} {self.seconds:7.0f} s {self.executions:>11,} runs {self.exec_per_s:>7,}/s "
                f"cov {self.coverage:>6,} ft {self.features:>6,} corpus {self.corpus:>5,} "
                f"rss {self.peak_rss_mb:>5,} MB  {verdict}")


def parse_output(result: RunResult, text: str) -> None:
    """Fill ``result`` from libFuzzer's status lines and final stats (``-print_final_stats=1``)."""
    for raw in text.splitlines():
        line = raw.strip()
        if m := _STATUS.match(line):
            result.executions, result.coverage, result.features, result.corpus = (int(g) for g in m.groups())
        elif m := _STAT.match(line):
            key, value = m.group(1), int(m.group(2))
            if key == "number_of_executed_units":
                result.executions = value
            elif key == "average_exec_per_sec":
                result.exec_per_s = value
            elif key == "peak_rss_mb":
                result.peak_rss_mb = value


def run_one(name: str, seconds: int, workdir: Path, timeout_s: int, rss_mb: int, max_len: int | None) -> RunResult:
    """Fuzz ``name`` for ``seconds`` in a process of its own; new inputs go to
    ``workdir/NAME/corpus``, crashing ones to ``workdir/NAME/``."""
    home = workdir / name
    corpus = home / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for old in home.iterdir():
        if old.name.startswith(ARTIFACT_PREFIXES):
            old.unlink()
    seeds = CORPUS / name
    args = [sys.executable, "-m", "fuzz.engine", name, str(rss_mb), str(corpus),
            *([str(seeds)] if seeds.is_dir() else []), f"-max_total_time={seconds}", f"-timeout={timeout_s}",
            f"-artifact_prefix={home}/", "-print_final_stats=1"]
    if max_len:
        args.append(f"-max_len={max_len}")
    # libFuzzer ends the process without running exit hooks: what a harness makes with tempfile
    # goes under a directory of this run's own, removed here
    scratch = home / "tmp"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    started = time.monotonic()
    try:
        proc = subprocess.run(args, cwd=ROOT.parent, capture_output=True, text=True, errors="replace", check=False,
                              timeout=seconds + 10 * timeout_s + 120, env={**os.environ, "TMPDIR": str(scratch)})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = RunResult(name, time.monotonic() - started, returncode=proc.returncode, log=proc.stdout + proc.stderr)
    (home / "log.txt").write_text(result.log)
    parse_output(result, result.log)
    result.artifacts = tuple(str(p) for p in sorted(home.iterdir()) if p.name.startswith(ARTIFACT_PREFIXES))
    return result


def replay(name: str, paths: list[Path]) -> list[tuple[Path, str]]:
    """Run every file of ``paths`` (files, or directories of them) through ``name``'s check in
    this process; the failures, each with its traceback."""
    check = load(name).make()
    files = [f for p in paths for f in (sorted(q for q in p.iterdir() if q.is_file()) if p.is_dir() else [p])]
    failures = []
    for f in files:
        try:
            check(f.read_bytes())
        except BaseException:  # every escape is the finding
            failures.append((f, traceback.format_exc()))
    return failures


def write_seeds(name: str) -> int:
    """Rewrite fuzz/corpus/NAME/ from the harness's ``seeds()``; how many were written."""
    seeds = load(name).seeds()
    out = CORPUS / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for seed_name, data in seeds.items():
        (out / re.sub(r"[^A-Za-z0-9_.-]", "_", seed_name)).write_bytes(data)
    return len(seeds)


def _names(given: list[str]) -> list[str]:
    for name in given:
        load(name)  # the error names the known targets
    return given or list(TARGETS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the harnesses")
    p_seeds = sub.add_parser("seeds", help="write fuzz/corpus/NAME/ from real encodings")
    p_seeds.add_argument("names", nargs="*", metavar="NAME")
    p_run = sub.add_parser("run", help="fuzz harnesses under libFuzzer, one process each, one after another")
    p_run.add_argument("names", nargs="*", metavar="NAME", help="harnesses to run (default: all)")
    p_run.add_argument("--seconds", type=int, default=20, help="seconds per harness (default 20)")
    p_run.add_argument("--timeout", type=int, default=10,
                       help="seconds one input may take before it counts as a hang (default 10)")
    p_run.add_argument("--rss-mb", type=int, default=2048,
                       help="resident memory a harness's process may reach before it counts as a crash (default 2048)")
    p_run.add_argument("--max-len", type=int, default=None, help="longest input libFuzzer makes (default: its own)")
    p_run.add_argument("--workdir", type=Path, default=Path(".kvstore/fuzz"),
                       help="where each harness's grown corpus, log and crashing inputs go (default .kvstore/fuzz)")
    p_replay = sub.add_parser("replay", help="run files through one harness in this process")
    p_replay.add_argument("name", metavar="NAME")
    p_replay.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    args = parser.parse_args(argv)

    if args.command == "list":
        print("\n".join(TARGETS))
        return 0
    if args.command == "seeds":
        for name in _names(args.names):
            print(f"{name}: {write_seeds(name)} seeds in {CORPUS / name}")
        return 0
    if args.command == "replay":
        failures = replay(args.name, args.paths)
        for path, tb in failures:
            print(f"{path}:\n{tb}")
        print(f"{args.name}: {len(failures)} failing input(s)")
        return 1 if failures else 0
    failed = 0
    for name in _names(args.names):
        print(f"fuzzing {name} for {args.seconds} s ...", flush=True)
        result = run_one(name, args.seconds, args.workdir.resolve(), args.timeout, args.rss_mb, args.max_len)
        print(result.line(), flush=True)
        if not result.ok:
            failed += 1
            print("\n".join(result.log.splitlines()[-40:]))
    print(f"{failed} harness(es) failed" if failed else "every harness ran clean")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
