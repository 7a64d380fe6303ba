"""Update docs/benchmarks.md from one ``kvstore bench`` run: the repository's job, not the package's.

Usage, from anywhere in the checkout::

    python scripts/update_benchmarks.py TARGET [FLAGS...]
    python scripts/update_benchmarks.py tiers
    python scripts/update_benchmarks.py engine --repeat 5
    python scripts/update_benchmarks.py --section serving-random serving --random-model --rounds 2

Everything from TARGET on is ``kvstore bench``'s command line. The bench runs (this checkout's
kvstore, its output shown as it goes) with ``--write`` into a temporary folder; then each
section it wrote replaces the section of the same name in docs/benchmarks.md (between
``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->``), and the files it wrote beside
it (plots under ``img/``, ``bench_tiers.json``) go to the same places beside
docs/benchmarks.md. ``--section NAME`` puts a bench's one section under another name (the
random-model run of ``bench serving`` is ``serving-random``).

Nothing changes unless the bench succeeded and docs/benchmarks.md already has a place for
every section it wrote: a new section's two markers are added by hand where it belongs.
Exit status: the bench's own when it fails, 2 for a usage error or a missing section, else 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's kvstore, wherever the script is run from

from kvstore.tools.bench.output import read_sections, write_section  # noqa: E402

WRITTEN = "benchmarks.md"  # the bench's --write file in the temporary folder


def run_bench(bench: list[str], work: Path) -> int:
    """``kvstore bench <bench> --write <work>/benchmarks.md`` from this checkout; its exit status."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "kvstore.cli", "bench", *bench, "--write", str(work / WRITTEN)]
    print("running:", " ".join(cmd[1:]), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def update(docs: Path, work: Path, section: str | None) -> list[str]:
    """Move what the bench wrote in ``work`` into ``docs`` and beside it; the problems that
    stopped it (nothing is changed then), or [] when it is done."""
    sections = read_sections((work / WRITTEN).read_text()) if (work / WRITTEN).exists() else {}
    if not sections:
        return [f"the bench wrote no section to {work / WRITTEN}"]
    if section is not None:
        if len(sections) != 1:
            return [f"--section {section} renames one section; the bench wrote {len(sections)}: {', '.join(sections)}"]
        sections = {section: next(iter(sections.values()))}
    page = docs.read_text()
    missing = [name for name in sections if f"<!-- bench:{name}:start -->" not in page]
    if missing:
        return [f"{docs} has no section {name}: add <!-- bench:{name}:start --> and <!-- bench:{name}:end --> "
                "where it belongs, then run this again" for name in missing]
    for name, text in sections.items():
        write_section(name, text, docs)
    for path in sorted(p for p in work.rglob("*") if p.is_file() and p != work / WRITTEN):
        target = docs.parent / path.relative_to(work)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        print(f"wrote {target}")
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="%(prog)s [--section NAME] [--docs FILE] TARGET [FLAGS...]")
    parser.add_argument("--section", help="the name the bench's one section takes in the page")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md",
                        help="the page to update (default: this checkout's docs/benchmarks.md)")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="kvstore bench's TARGET and its flags")
    args = parser.parse_args(argv)
    if not args.bench or args.bench[0].startswith("-"):
        parser.error("name a kvstore bench TARGET (and its flags) after this script's own options")
    if "--write" in args.bench or any(a.startswith(("--write=", "--plot")) for a in args.bench):
        parser.error("--write and --plot are this script's to give")
    if not args.docs.is_file():
        parser.error(f"{args.docs} does not exist")
    with tempfile.TemporaryDirectory(prefix="kvstore-update-benchmarks-") as tmp:
        status = run_bench(args.bench, Path(tmp))
        if status != 0:
            print(f"the bench failed (exit {status}); {args.docs} is unchanged", file=sys.stderr)
            return status
        problems = update(args.docs, Path(tmp), args.section)
    for problem in problems:
        print(f"update_benchmarks: {problem}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
