"""Byte sizes as operators write them (``512MiB``, ``20GiB``): every CLI flag and TOML key of a size."""

from __future__ import annotations

import re

from kvstore.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
          "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4,
          "tib": 1 << 40}
MAX_SIZE = (1 << 63) - 1  # bytes: the largest file offset


def parse_size(text: str | int) -> int:
    """``"512MiB"`` -> 536870912; plain ints pass through. ConfigError for anything else, and
    for a size below 0 or above MAX_SIZE."""
    if isinstance(text, int) and not isinstance(text, bool):
        size: float = text
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"size {text!r} is not a number with an optional unit like 512MiB or 20GiB")
        size = float(match.group(1)) * _UNITS[match.group(2).lower()]  # inf past ~1e308
    if not 0 <= size <= MAX_SIZE:
        shown = str(text) if len(str(text)) <= 40 else f"{str(text)[:16]}... ({len(str(text))} characters)"
        raise ConfigError(f"size {shown} is out of range: 0 to {MAX_SIZE} bytes")
    return int(size)


def format_size(size: int) -> str:
    """``1073741824`` -> ``"1GiB"``: the largest binary unit that divides ``size`` exactly
    (so that ``parse_size`` reads the same number back)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)
