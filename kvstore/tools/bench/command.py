"""``kvstore bench TARGET``: the dispatcher. Each target's module adds its own subcommand
(``register_target``); this module only gathers them under ``kvstore bench``."""

from __future__ import annotations

import argparse
import importlib

# One module per target, in the order ``kvstore bench --help`` lists them.
TARGET_MODULES = ("tiers", "engine", "daemon", "remote", "vllm", "vs_vllm", "serving", "route", "codecs", "quality",
                  "pool", "events", "route_live", "tenants")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="measure kvstore against same-run baselines",
                                   description="Measure kvstore against baselines timed in the same run; "
                                   "results print and go to docs/benchmarks.md (--no-write: print only).")
    targets = parser.add_subparsers(dest="target", metavar="TARGET")
    targets.required = True
    for name in TARGET_MODULES:
        importlib.import_module(f"kvstore.tools.bench.{name}").register_target(targets)
