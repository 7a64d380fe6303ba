"""Per-tier counters, as reported by ``TieredStore.stats()`` (and through it the daemon's REST and /metrics)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class TierCounters:
    """Monotonic counters of one tier. ``hits``/``misses`` count blocks asked of this tier."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    refused: int = 0  # blocks whose encoding (another codec's format version) this reader refuses

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def tier_stats(
    counters: TierCounters, capacity_bytes: int, num_blocks: int, slot_bytes: int, extra_errors: int = 0
) -> dict[str, int]:
    """One tier's entry of ``stats()``: occupancy plus counters."""
    out = {
        "capacity_bytes": capacity_bytes,
        "used_bytes": num_blocks * slot_bytes,
        "num_blocks": num_blocks,
    }
    out.update(counters.as_dict())
    out["errors"] += extra_errors
    return out


def is_count(value: Any) -> bool:
    """Whether a ``stats()`` value is a number to sum (not the tier's codec name or lossy flag)."""
    return isinstance(value, int) and not isinstance(value, bool)
