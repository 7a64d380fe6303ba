"""argparse types shared by the command line's subcommands."""

from __future__ import annotations

import argparse
import sys
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


class RenamedFlag(argparse.Action):
    """The old spelling of a renamed flag: sets the new flag's destination and warns on stderr
    (``add_argument("--old", dest="new", action=RenamedFlag, new_flag="--new")``)."""

    def __init__(self, *args: Any, new_flag: str, **kwargs: Any) -> None:
        self.new_flag = new_flag
        kwargs.setdefault("help", f"old spelling of {new_flag} (warns)")
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"kvstore: {option_string} is spelled {self.new_flag} now; the old flag still works",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: any free port); anything else is a usage error."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0-65535, got {text!r}")
    return value
