"""Cache management of one store: pins (with holders and TTLs), prefetch, inspect, delete with descendants.

``TieredStore`` delegates here (forgetting a tenant is kvstore/store/forget.py). Every operation is
tenant-blind: keys name blocks, and whoever calls has scoped them (a daemon files every key
under its connection's tenant). What it returns is small and typed (``BlockInfo``,
``PrefetchHandle``), never an index entry.

Bounds, each a ValueError naming it before any work: a prefetch or an inspect names at most
``MAX_KEYS`` keys; a pin's ``ttl_s`` is in (0, a day] (kvstore/store/pins.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from kvstore.api import check_count, check_ttl
from kvstore.errors import CapacityError
from kvstore.results import BlockInfo, PrefetchHandle
from kvstore.store.cascade import Cascade
from kvstore.store.index import BlockEntry
from kvstore.store.pins import PinLedger
from kvstore.store.reads import ReadPath


class Management:
    """Pins, prefetch, inspect and delete over one store's cascade."""

    def __init__(self, cascade: Cascade, reads: ReadPath, executor: Executor, codecs: Callable[[], dict[str, Any]]
                 ) -> None:
        self.cascade = cascade
        self.reads = reads
        self.executor = executor
        self.pins = PinLedger(cascade.lock)
        self._codecs = codecs

    # ----------------------------------------------------------------------------- pins

    def pin(self, keys: list[bytes], ttl_s: float | None, holder: int | None) -> None:
        ttl = check_ttl(ttl_s)
        with self.cascade.lock:
            self.cascade.inflight.wait_written(keys)
            self.pins.pin(self._require(keys), ttl, holder)

    def unpin(self, keys: list[bytes], holder: int | None) -> None:
        with self.cascade.lock:
            self.cascade.inflight.wait_written(keys)
            self.pins.unpin(self._require(keys), holder)

    def end_pins(self, holder: int) -> int:
        with self.cascade.lock:
            return self.pins.end_holder(holder)

    def _require(self, keys: list[bytes]) -> list[BlockEntry]:
        entries = []
        for key in keys:
            entry = self.cascade.index.get(key)
            if entry is None:
                raise KeyError(f"block {key.hex()} is not in the store")
            entries.append(entry)
        return entries

    # ----------------------------------------------------------------------------- prefetch

    def prefetch(self, keys: list[bytes]) -> PrefetchHandle:
        check_count("prefetch", len(keys))
        self.cascade.check_open()
        return PrefetchHandle.of_future(self.executor.submit(self._prefetch, keys), len(keys))

    def _prefetch(self, keys: list[bytes]) -> int:
        """Bring the leading run held anywhere up to host RAM (as a get would, without a
        destination); how many of ``keys`` host RAM holds then."""
        self.reads.read_into(keys, None)
        with self.cascade.lock:
            entries = self.cascade.index.entries
            return sum(1 for k in keys if (e := entries.get(k)) is not None and e.slots[0] is not None)

    # ----------------------------------------------------------------------------- inspect

    def inspect(self, keys: list[bytes]) -> list[BlockInfo | None]:
        """Per key, where its block is (every local tier, and the shared ones asked once)."""
        check_count("inspect", len(keys))
        cascade = self.cascade
        codecs = self._codecs()
        found: list[dict[str, Any] | None] = []
        with cascade.lock:
            cascade.check_open()
            names = cascade.index.level_names
            now = time.monotonic()
            for key in keys:
                entry = cascade.index.get(key)
                if entry is None or not (entry.is_held or entry.writing):
                    found.append(None)
                    continue
                ranks = [r for r, slot in enumerate(entry.slots) if slot is not None] or [entry.landing]
                found.append({"tiers": [names[r] for r in ranks], "tenant": entry.tenant, "pins": entry.pins,
                              "pin_expires_s": self.pins.expires_in(entry, now) if entry.pins else None})
        for shared in cascade.shared:  # lock free: this asks the network
            for i, held in enumerate(shared.holds(keys)):
                if held:
                    row = found[i] or {"tiers": [], "tenant": None, "pins": 0, "pin_expires_s": None}
                    row["tiers"].append(shared.name)
                    found[i] = row
        out: list[BlockInfo | None] = []
        for key, got in zip(keys, found, strict=True):
            if got is None:
                out.append(None)
                continue
            row = dict(got)
            tiers = tuple(row.pop("tiers"))
            out.append(BlockInfo(key, tiers, {t: codecs[t]["codec"] for t in tiers},
                                 {t: int(codecs[t]["block_bytes"]) for t in tiers}, **row))
        return out

    # ----------------------------------------------------------------------------- delete

    def delete(self, keys: list[bytes], descendants: bool) -> tuple[int, list[bytes]]:
        """Remove the blocks of ``keys`` (and with ``descendants``, every block chained below
        one of them that the index links to its parent) from every local tier, all or none.
        Returns how many were held, and every key to discard from the shared levels too.

        Raises:
            CapacityError: one of them is pinned or being read (nothing is deleted then).
        """
        cascade = self.cascade
        with cascade.lock:
            while True:
                cascade.check_open()
                entries = self._entries(keys, descendants)
                doomed = [e.key for e in entries]
                if not cascade.inflight.any_written(doomed):
                    break
                cascade.inflight.wait_written(doomed)  # lets the lock go: look again after
            busy = [e for e in entries if not e.is_evictable]
            if busy:
                raise CapacityError(f"{len(busy)} of {len(entries)} blocks are pinned or being read, "
                                    f"first {busy[0].key.hex()}")
            cascade.placement.delete(entries)
        return len(entries), list(dict.fromkeys([*keys, *doomed]))

    def _entries(self, keys: list[bytes], descendants: bool) -> list[BlockEntry]:
        index = self.cascade.index
        entries = [e for e in (index.get(k) for k in dict.fromkeys(keys)) if e is not None]
        if not descendants:
            return entries
        children: dict[bytes, list[BlockEntry]] = {}
        for entry in index.entries.values():  # one pass over the index: no child links are kept
            if entry.parent is not None:
                children.setdefault(entry.parent, []).append(entry)
        seen = {id(e) for e in entries}
        todo = list(dict.fromkeys(keys))
        while todo:
            for child in children.get(todo.pop(), ()):
                if id(child) not in seen:
                    seen.add(id(child))
                    entries.append(child)
                    todo.append(child.key)
        return entries

    def check(self) -> None:
        self.pins.check(list(self.cascade.index.entries.values()))

    def close(self) -> None:
        self.pins.close()
