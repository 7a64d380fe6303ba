"""``kvstore demo``: the command. By default the engine's multi-turn chat (``engine_chat``);
``--store-only`` runs the store alone with stand-in KV (``store_chat``).
"""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    if args.store_only:
        from kvstore.tools.demo.store_chat import run as run_store_demo

        return run_store_demo(args)
    from kvstore.tools.demo.engine_chat import run as run_engine_demo

    return run_engine_demo(args)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="multi-turn chat workload showing blocks move between tiers")
    parser.add_argument("--data-dir", default="./.kvstore", help="where the disk tier lives (default ./.kvstore)")
    parser.add_argument("--users", type=int, default=3, help="conversations (default 3)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    parser.add_argument("--host-blocks", type=int, default=32, help="host tier capacity in blocks (default 32)")
    parser.add_argument("--disk-blocks", type=int, default=512, help="disk tier capacity in blocks (default 512)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fresh", action="store_true", help="start from an empty disk tier")
    parser.add_argument("--store-only", action="store_true",
                        help="run the store alone with stand-in KV (no model); default: the engine")
    from kvstore.tools.demo.engine_chat import add_arguments

    add_arguments(parser)
    parser.set_defaults(func=lambda args: run(args) if _check(args) else 2)


def _check(args: argparse.Namespace) -> bool:
    for name in ("users", "turns", "host_blocks", "disk_blocks"):
        if getattr(args, name) < 1:
            print(f"kvstore demo: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return False
    return True
