"""``python -m kvstore.services.daemon serve ...``: the daemon alone, without the other subcommands."""

from __future__ import annotations

import argparse
import sys

from kvstore.services.daemon import cli


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.services.daemon")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    cli.register(subparsers)
    args = parser.parse_args()
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
