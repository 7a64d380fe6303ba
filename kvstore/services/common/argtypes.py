"""argparse types shared by the command line's subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def positive(kind: type, what: str = "") -> Callable[[str], Any]:
    """A type that parses ``kind`` (int or float) and accepts only finite values above 0;
    anything else is a usage error (argparse names the flag; ``what`` names a part of one)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0 or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{what + ' ' if what else ''}must be a positive {kind.__name__}, "
                                             f"got {text!r}")
        return value

    return parse


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: any free port); anything else is a usage error."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0-65535, got {text!r}")
    return value
