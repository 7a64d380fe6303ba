"""The harnesses, one module each; ``TARGETS`` is their list (``python -m fuzz list``).

Each module defines:

- ``make() -> Callable[[bytes], None]``: builds what the harness needs once (a store, a
  layout, a temporary directory) and returns ``check``, which runs one input. ``check``
  catches the errors the decoder may raise for bad bytes and lets anything else escape.
- ``seeds() -> dict[str, bytes]``: named real encodings (what the decoder reads in service),
  written to fuzz/corpus/NAME/ by ``python -m fuzz seeds``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

TARGETS: tuple[str, ...] = (
    "frames",
    "codecs",
    "remote_values",
    "remote_replies",
    "events_wire",
    "events_replay",
    "gguf",
    "gguf_tokenizer",
    "tokens_file",
    "daemon_toml",
    "quotas",
    "trace",
)

Check = Callable[[bytes], None]


def load(name: str) -> ModuleType:
    """The harness ``name`` of ``TARGETS``, or any module given by its dotted path (a harness
    of your own, or fuzz.selftest); ValueError naming the known ones otherwise."""
    if "." in name:
        return importlib.import_module(name)
    if name not in TARGETS:
        raise ValueError(f"no fuzz target {name!r}; known: {', '.join(TARGETS)} (or a module's dotted path)")
    return importlib.import_module(f"fuzz.targets.{name}")
