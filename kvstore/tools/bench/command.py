"""``kvstore bench TARGET``: the dispatcher. Each target's module adds its own subcommand
(``register_target``); this module only gathers them under ``kvstore bench``, and turns a
missing ``bench`` extra (bench.extras) into one line instead of a traceback."""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Callable

from kvstore.tools.bench.extras import MissingExtra

# One module per target, in the order ``kvstore bench --help`` lists them.
TARGET_MODULES = ("tiers", "engine", "hybrid", "daemon", "remote", "vllm", "vs_vllm", "serving", "route", "codecs", "quality",
                  "pool", "events", "route_live", "tenants")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="measure kvstore against same-run baselines",
                                   description="Measure kvstore against baselines timed in the same run. Results "
                                   "print; --write PATH also writes them, as their section of a benchmarks page "
                                   "(scripts/update_benchmarks.py updates the repository's docs/benchmarks.md).")
    targets = parser.add_subparsers(dest="target", metavar="TARGET")
    targets.required = True
    for name in TARGET_MODULES:
        importlib.import_module(f"kvstore.tools.bench.{name}").register_target(targets)
    for target in targets.choices.values():
        target.set_defaults(func=_naming_missing_extras(target.get_default("func"), target.prog))


def _naming_missing_extras(func: Callable[[argparse.Namespace], int], command: str
                           ) -> Callable[[argparse.Namespace], int]:
    """``func``, with a missing matplotlib or tqdm one line on stderr (exit 2), not a traceback."""

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except MissingExtra as exc:
            print(f"{command}: {exc}", file=sys.stderr)
            return 2

    return run
