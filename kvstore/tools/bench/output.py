"""Where a benchmark's results go: stdout always, a file only where ``--write PATH`` says.

Every ``kvstore bench`` target prints its results, the markdown section it would write. With
``--write PATH`` it also writes that section to PATH, between ``<!-- bench:NAME:start -->``
and ``<!-- bench:NAME:end -->``: a new file holds the section alone (under a ``# Benchmarks``
title), an existing one gets that section replaced, or appended, and keeps the rest. The files
a section refers to go beside PATH: a plot under ``img/`` (``--plot PATH`` puts it elsewhere,
and draws it without ``--write`` too), ``kvstore bench tiers``'s ``bench_tiers.json``. Nothing
is written anywhere else, and no path comes from where the package is installed.

Updating the repository's docs/benchmarks.md is scripts/update_benchmarks.py's job (a bench
run with ``--write`` into a temporary folder, then the matching section replaced).
``--write docs/benchmarks.md`` does the same by hand.

``--no-write``, once the way to print only, still parses and warns: printing only is the default.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Any

from kvstore.tools.bench import extras

SECTION = re.compile(r"<!-- bench:(?P<name>[\w.-]+):start -->\n?(?P<body>.*?)\n?<!-- bench:(?P=name):end -->",
                     re.DOTALL)


class _OldNoWrite(argparse.Action):
    """``--no-write``: printing only is the default now; say so on stderr and change nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.update(nargs=0, default=argparse.SUPPRESS)
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"kvstore bench: {option_string} is the default now (results print; --write PATH writes them "
              "too); the old flag still works", file=sys.stderr)


def add_output_arguments(parser: argparse.ArgumentParser, *, plot: str | None = None,
                         beside: str | None = None) -> None:
    """``--write PATH`` and the old ``--no-write``; with ``plot`` (the file name a plot takes
    beside ``--write``, under ``img/``), ``--plot PATH`` as well. ``beside``: the name of a file
    the bench writes beside ``--write`` (its help says so)."""
    named = ([f"img/{plot}"] if plot else []) + ([beside] if beside else [])
    besides = f"; {' and '.join(named)} beside it" if named else ""
    parser.add_argument("--write", metavar="PATH", type=Path, default=None,
                        help="also write the results to PATH as their section of a benchmarks page (a new file, "
                        f"or that section of an existing one replaced{besides}). Default: print only")
    parser.add_argument("--no-write", action=_OldNoWrite, help="old spelling of the default, print only (warns)")
    if plot:
        parser.add_argument("--plot", metavar="PATH", type=Path, default=None,
                            help=f"draw the plot to PATH (needs matplotlib: {extras.INSTALL}); default: "
                            f"img/{plot} beside --write, else none")


def beside_write(args: argparse.Namespace, name: str) -> Path | None:
    """Where a file the section refers to goes: ``name`` in ``--write``'s folder; None without ``--write``."""
    return args.write.parent / name if args.write is not None else None


def plot_path(args: argparse.Namespace, name: str) -> Path | None:
    """Where the plot goes: ``--plot``, else ``img/<name>`` beside ``--write``, else None (no plot)."""
    if args.plot is not None:
        return Path(args.plot)
    return beside_write(args, os.path.join("img", name))


def check_plot(args: argparse.Namespace, name: str, command: str) -> bool:
    """Before anything is measured: a plot that will be drawn needs matplotlib. False, after one
    line on stderr saying how to install it, when it is missing."""
    if plot_path(args, name) is None or extras.available("matplotlib"):
        return True
    print(f"{command}: drawing {name} needs matplotlib: {extras.INSTALL}", file=sys.stderr)
    return False


def image_line(args: argparse.Namespace, path: Path, alt: str) -> str:
    """The markdown of an image at ``path``: relative to ``--write``'s folder where it lies
    under it (the link a benchmarks page needs), else the path as given."""
    shown = str(path)
    if args.write is not None:
        with contextlib.suppress(ValueError):  # not under it: the path as given
            shown = path.resolve().relative_to(args.write.resolve().parent).as_posix()
    return f"![{alt}]({shown})"


def publish(args: argparse.Namespace, name: str, text: str) -> None:
    """Print the section ``name``; write it where ``--write`` says, if it says."""
    print(text)
    if args.write is not None:
        write_section(name, text, args.write)


def write_section(name: str, text: str, path: Path) -> None:
    """Replace the text between ``<!-- bench:NAME:start -->`` and its end marker in ``path``
    (a new file, or the section appended, where there is none yet), and say so."""
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    doc = path.read_text() if path.exists() else f"# Benchmarks\n\n{start}\n{end}\n"
    if start not in doc:
        doc += f"\n{start}\n{end}\n"
    head, rest = doc.split(start, 1)
    _, tail = rest.split(end, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{head}{start}\n{text}\n{end}{tail}")
    print(f"wrote {path} ({name} section)")


def read_sections(doc: str) -> dict[str, str]:
    """Each ``<!-- bench:NAME:start -->`` section of ``doc``: its name -> its text, in order."""
    return {m["name"]: m["body"] for m in SECTION.finditer(doc)}

