"""The remote tier's own counters (the nodes' memory and evictions come from INFO, see info.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

ERROR_KINDS = ("timeout", "connection", "auth", "cluster", "oom", "unavailable", "corrupt", "other")


@dataclass
class RemoteCounters:
    """Monotonic counters. ``errors`` is the sum of ``error_kinds``; ``corrupt_reasons`` says
    which header field or the checksum rejected a value (each such value was deleted)."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    dropped: int = 0  # blocks a write gave up on: full queue, or the node failed
    skipped: int = 0  # blocks not sent because the remote already held them
    round_trips: int = 0  # requests a caller waited for (lookups, reads, deletes): nodes in parallel count once
    hint_hits: int = 0  # blocks a lookup or read answered from a fresh hint, with no request
    hint_misses: int = 0  # blocks a lookup had to ask the remote about
    kept_used: int = 0  # values a read took from the lookup before it instead of asking again
    replica_reads: int = 0  # node pipelines of reads a replica answered for its failed primary (READONLY)
    error_kinds: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))
    corrupt_reasons: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def error(self, kind: str, amount: int = 1, reason: str = "") -> None:
        with self._lock:
            self.errors += amount
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + amount
            if reason:
                self.corrupt_reasons[reason] = self.corrupt_reasons.get(reason, 0) + amount

    def snapshot(self) -> dict[str, int]:
        """Flat ints: the counters, then ``errors_<kind>`` and ``corrupt_<reason>``."""
        with self._lock:
            flat = {f.name: getattr(self, f.name) for f in fields(self) if f.type == "int"}
            flat.update({f"errors_{k}": v for k, v in self.error_kinds.items()})
            flat.update({f"corrupt_{k}": v for k, v in self.corrupt_reasons.items()})
            return flat
