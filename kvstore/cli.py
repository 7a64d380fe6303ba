"""The ``kvstore`` command line: one subcommand per job, each registered by its own module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from kvstore.services.daemon import cli as daemon_cli
    from kvstore.services.engine_server import cli as engine_cli
    from kvstore.services.router import cli as route_cli
    from kvstore.tools import watch_events as events_cli
    from kvstore.tools.bench import command as bench
    from kvstore.tools.demo import command as demo
    from kvstore.tools.replay import command as replay

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
    engine_cli.register(subparsers)
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
