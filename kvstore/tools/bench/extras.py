"""The ``kvstore[bench]`` extra: matplotlib and tqdm, which only the benchmarks and tools use.

Neither is a dependency of ``pip install kvstore`` (the vLLM connector's install pulls in
neither through kvstore). Each is imported here, inside the function that draws or shows
progress, never at a module's top: ``kvstore --help`` and every import of the library work
without them. Without matplotlib a plot fails before anything is measured, with one line
that says how to get it (``MissingExtra``); without tqdm a progress bar is a plain line on
stderr now and then.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Protocol

INSTALL = "pip install 'kvstore[bench]'"
PLAIN_EVERY_S = 10.0  # without tqdm: a progress line at most this often


class MissingExtra(RuntimeError):
    """A module of the ``bench`` extra is not installed; the message is one line naming ``INSTALL``."""


def available(module: str) -> bool:
    """Whether ``module`` (top-level: ``matplotlib``, ``tqdm``) can be imported here."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules holds it as None (blocked)
        return False


def require(module: str, what: str) -> None:
    """MissingExtra ``"<what> needs <module>: pip install 'kvstore[bench]'"`` unless ``module`` imports."""
    if not available(module):
        raise MissingExtra(f"{what} needs {module}: {INSTALL}")


def pyplot(what: str = "a plot") -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display); MissingExtra without it."""
    try:
        import matplotlib
    except ImportError:
        raise MissingExtra(f"{what} needs matplotlib: {INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class Progress(Protocol):
    def update(self, n: int = 1) -> None: ...


class _PlainProgress:
    """tqdm's ``update`` without tqdm: a line on stderr at most every ``PLAIN_EVERY_S`` seconds."""

    def __init__(self, total: int, unit: str) -> None:
        self.total, self.unit, self.done = total, unit, 0
        self._last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.done += n
        if time.monotonic() - self._last >= PLAIN_EVERY_S:
            self._last = time.monotonic()
            print(f"{self.done:,} of {self.total:,} {self.unit}", file=sys.stderr, flush=True)


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass


@contextmanager
def progress_bar(total: int, unit: str, *, disable: bool = False) -> Iterator[Progress]:
    """A progress bar on stderr that the caller ``update``s: tqdm's where it is installed,
    plain lines where it is not (``disable``: nothing at all)."""
    if disable:
        yield _NoProgress()
        return
    if not available("tqdm"):
        yield _PlainProgress(total, unit)
        return
    from tqdm import tqdm

    with tqdm(total=total, unit=unit, file=sys.stderr, leave=False) as bar:
        yield bar
