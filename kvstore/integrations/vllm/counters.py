"""Process-wide counters of the kvstore connectors (both roles), for logs, tests and benchmarks."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class ConnectorCounters:
    """Monotonic since the process started; ``snapshot()`` for a copy, differences for a run.

    Attributes:
        lookups, lookup_blocks, hit_blocks: scheduler-side lookups, blocks asked, blocks held.
        loaded_blocks, load_errors: blocks copied into vLLM; blocks a load could not deliver
            (corrupt, vanished, store down) and reported for recompute. A hybrid model's
            blocks are per KV group (one vLLM block of one group's layers).
        loaded_window_blocks, loaded_bytes: of the loaded blocks, those of sliding-window groups;
            the bytes of all of them.
        async_loads: loads run outside the step.
        saved_blocks, save_skipped: blocks put; blocks not put (store down or full).
        cooled_blocks: sliding-window blocks below the window made the store's next victims
            (those it held).
        lookup_ns, save_ns: time the connector spent on vLLM's critical path in lookups
            (scheduler) and in saves (gathers in the forward, queueing in wait_for_save); the
            puts themselves run on the saver thread and are not counted.
    """

    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    loaded_blocks: int = 0
    load_errors: int = 0
    loaded_window_blocks: int = 0
    loaded_bytes: int = 0
    async_loads: int = 0
    saved_blocks: int = 0
    save_skipped: int = 0
    cooled_blocks: int = 0
    lookup_ns: int = 0
    save_ns: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}


COUNTERS = ConnectorCounters()

_saves_in_flight = 0
_saves_done = threading.Condition()


def save_started() -> None:
    global _saves_in_flight
    with _saves_done:
        _saves_in_flight += 1


def save_finished() -> None:
    global _saves_in_flight
    with _saves_done:
        _saves_in_flight -= 1
        _saves_done.notify_all()


def flush(timeout: float = 60.0) -> bool:
    """Wait until every save this process's connectors started has reached the store (or
    failed); False if some are still running after ``timeout`` seconds."""
    with _saves_done:
        return _saves_done.wait_for(lambda: _saves_in_flight == 0, timeout)
