"""The ``kvstore`` command line: one subcommand per job, each registered by its own module."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from kvstore import bench, demo
    from kvstore.daemon import cli as daemon_cli
    from kvstore.events import command as events_cli
    from kvstore.replay import command as replay
    from kvstore.route import cli as route_cli

    parser = argparse.ArgumentParser(
        prog="kvstore",
        description="kvstore: a tiered KV-cache store for LLM inference (device, host RAM, NVMe, and a Redis Cluster shared by nodes).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    demo.register(subparsers)
    bench.register(subparsers)
    replay.register(subparsers)
    daemon_cli.register(subparsers)
    events_cli.register(subparsers)
    route_cli.register(subparsers)
    if importlib.util.find_spec("engine"):  # `kvstore engine`, where the engine package is installed
        importlib.import_module("engine.serve.cli").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
