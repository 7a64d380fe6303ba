"""Host-slot leases: zero-copy access to the host tier for a process that maps the shared pool.

``TieredStore``'s lease methods call these functions (split out of store.py for length; they
work on the store's internals under its lock); the daemon's shared-memory path is their only
user. A read lease holds blocks like an in-flight get (``readers += 1``: never
evicted, never deleted); a write lease is a set of reserved free slots that hold no block until
``commit_host`` publishes them, so no lookup can see a half-written slot.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.errors import CapacityError
from kvstore.index import DISK, HOST, BlockEntry

if TYPE_CHECKING:
    from kvstore.store import TieredStore


def shared_pool(store: TieredStore) -> tuple[str, int, int] | None:
    """``(path, slot_bytes, num_slots)`` of the shared host pool, or None if not shared."""
    path = store._host.shm_path
    return None if path is None else (path, store._host.slot_bytes, store._host.num_slots)


def acquire_host(store: TieredStore, keys: Sequence[bytes]) -> list[int]:
    """Hold the leading run of ``keys`` in host RAM and return its host slot ids.

    Disk-only blocks of the run are promoted first (as by get). The run stops at the
    first block that is missing or could not be brought to host. Counted like a get.

    Returns:
        Host slot ids of blocks ``keys[:n]``; each is held (never evicted, deleted or
        reused) until ``release_host(keys[:n])``.
    """
    keys = store._check_keys(keys)
    with store._lock:
        store._check_open()
        match = store._index.match(keys)
        store._count_lookup(match, len(keys))
    if DISK in match.tiers:
        store._read_into(keys[: match.num_blocks], None)
    with store._lock:
        store._check_open()
        held: list[BlockEntry] = []
        for key in keys[: match.num_blocks]:
            entry = store._index.get(key)
            if entry is None or entry.host_slot is None:
                break
            entry.readers += 1
            store._note_use(entry)
            held.append(entry)
        if held:
            store._host_policy.access([e.key for e in held])
        store._counters[HOST].bytes_read += len(held) * store._payload
        return [e.host_slot for e in held]  # type: ignore[misc]


def release_host(store: TieredStore, keys: Sequence[bytes]) -> None:
    """End a read lease: undo one ``acquire_host`` of each of ``keys``."""
    keys = store._check_keys(keys)
    with store._lock:
        for key in keys:
            entry = store._index.entries[key]
            assert entry.readers > 0, f"block {key.hex()} released but not held"
            entry.readers -= 1
            if entry.best_tier is None and entry.readers == 0:
                store._forget(entry)


def reserve_host(store: TieredStore, n: int) -> list[int]:
    """Take ``n`` free host slots (evicting as a put would) for a writer outside the store.

    Raises:
        CapacityError: fewer than ``n`` slots can be freed (the rest pinned or in flight).
    """
    with store._lock:
        store._check_open()
        if n > store._host.num_slots - store._reserved_host:  # hopeless: evict nothing
            raise CapacityError(f"need {n} host slots, {store._host.num_slots} in the pool, "
                                f"{store._reserved_host} of them reserved")
        if store._host.num_free < n:
            store._evict_host(n - store._host.num_free)
        if store._host.num_free < n:
            raise CapacityError(f"need {n} host slots, {store._host.num_free} free of "
                                f"{store._host.num_slots} (the rest pinned or being read)")
        store._reserved_host += n
        return store._host.allocate(n)


def cancel_host(store: TieredStore, slots: Sequence[int]) -> None:
    """Give reserved slots back unpublished."""
    with store._lock:
        store._reserved_host -= len(slots)
        store._host.release(slots)


def commit_host(store: TieredStore, keys: Sequence[bytes], slots: Sequence[int], *, tenant: str = "") -> None:
    """Publish ``keys[i]`` as the bytes just written into reserved ``slots[i]``.

    Same semantics as put: a key already in host RAM keeps its copy (the reserved slot is
    freed); under write-through the new blocks reach disk before this returns.
    """
    keys = store._check_keys(keys)
    if len(keys) != len(slots):
        raise ValueError(f"{len(keys)} keys for {len(slots)} slots")
    with store._lock:
        store._check_open()
        store._reserved_host -= len(slots)
        now = time.time()
        placed: list[BlockEntry] = []
        placed_slots: list[int] = []
        refreshed: list[bytes] = []
        for i, (key, slot) in enumerate(zip(keys, slots, strict=True)):
            entry = store._index.get(key)
            if entry is None:
                entry = BlockEntry(key, keys[i - 1] if i > 0 else None, tenant, now)
                store._index.add(entry)
            store._note_use(entry, now)
            if entry.host_slot is not None:
                store._host.release([slot])
                refreshed.append(key)
                continue
            placed.append(entry)
            placed_slots.append(slot)
        store._publish_on_host(placed, placed_slots, refreshed)
