"""Demoter: writes device blocks to the store on a background thread.

The engine loop gathers the blocks' bytes out of the pool (a block may be reused right after)
and submits them: blocks a step just filled (write-through), or evicted blocks the store lacks
(write-back, or a write-through that was skipped). The store's ``put`` (the host copy, and
behind it any disk write, sync and catalog commit of the store's own cascade) runs here, off
the engine loop: no request waits for it. ``queued(keys)`` says which keys a queued run holds,
so evicting a block whose write-through is still queued gathers nothing again. A hybrid
model's runs are per KV group (``group``; keys are the group's, ``tags`` the device blocks'
chain keys that ``queued`` answers for), and ``cool`` queues a hint behind the puts before it.

Bounded: at most ``max_pending_bytes`` of gathered payloads wait at a time. A submission
beyond that is dropped and counted (a cache may lose a demotion; it must not stall a request
or grow without limit), or, for a write-through, skipped and counted apart (the block is still
on the device). ``drain()`` waits until everything submitted is stored or dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import torch

from kvstore.api import BlockStore
from kvstore.errors import KVStoreError, TierFullError

log = logging.getLogger("kvstore.engine.demoter")


class Demoter:
    """One worker thread putting runs of blocks into ``store``, in submission order."""

    def __init__(self, store: BlockStore, max_pending_bytes: int) -> None:
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        self.num_demoted = 0  # blocks the store took
        self.num_dropped = 0  # blocks lost: over the bound, the store full, or an error
        self.num_skipped = 0  # write-through blocks not queued (over the bound; still on the device)
        self.busy_s = 0.0  # seconds the worker spent storing
        # (keys, payload or None for a cool, tenant, group, tags)
        self._queue: deque[tuple[list[bytes], torch.Tensor | None, str, int | None, list[bytes]]] = deque()
        self._queued_keys: dict[bytes, int] = {}  # key -> runs queued or being stored holding it
        self._pending_bytes = 0
        self._busy = 0  # blocks of the run being stored
        self._active = False  # a job (a run, or a cool) is being carried out
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="engine-demoter", daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        """Blocks submitted and not yet stored or dropped (the run being stored included)."""
        with self._cv:
            return sum(len(keys) for keys, payload, *_ in self._queue if payload is not None) + self._busy

    def submit(self, keys: list[bytes], payload: torch.Tensor, tenant: str, optional: bool = False,
               group: int | None = None, tags: list[bytes] | None = None) -> bool:
        """Queue one chain run (``payload[i]`` is ``keys[i]``'s block; ``group``: their KV
        group; ``tags``: the keys ``queued`` knows them by, default ``keys``); False if over the
        bound (counted as dropped unless ``optional``: a write-through whose blocks stay on
        the device)."""
        size = payload.numel() * payload.element_size()
        tags = keys if tags is None else tags
        with self._cv:
            if self._closed or self._pending_bytes + size > self.max_pending_bytes:
                self.num_dropped += 0 if optional else len(keys)
                self.num_skipped += len(keys) if optional else 0
                return False
            self._queue.append((keys, payload, tenant, group, tags))
            for key in tags:
                self._queued_keys[key] = self._queued_keys.get(key, 0) + 1
            self._pending_bytes += size
            self._cv.notify_all()
        return True

    def cool(self, keys: list[bytes]) -> None:
        """Queue ``store.cool(keys)`` after the puts queued before it (which may hold them)."""
        if keys:
            with self._cv:
                if not self._closed:
                    self._queue.append((keys, None, "", None, []))
                    self._cv.notify_all()

    def queued(self, keys: list[bytes]) -> list[bool]:
        """Per key, whether a run holding its bytes is queued or being stored: evicting such a
        block needs no second gather."""
        with self._cv:
            return [key in self._queued_keys for key in keys]

    def drain(self) -> None:
        """Wait until every submitted run is stored (or dropped)."""
        with self._cv:
            while self._queue or self._active:
                self._cv.wait()

    def close(self) -> None:
        """Store what is queued, then stop the worker."""
        self.drain()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                keys, payload, tenant, group, tags = self._queue.popleft()
                self._busy = len(keys) if payload is not None else 0
                self._active = True
            t0 = time.perf_counter()
            try:
                if payload is None:
                    self.store.cool(keys)
                else:
                    self._store(keys, payload, tenant, group)
            except Exception:  # a store or daemon failure costs these blocks, never the engine
                log.exception("demoting %d blocks failed", len(keys))
                self.num_dropped += len(keys) if payload is not None else 0
            finally:
                self.busy_s += time.perf_counter() - t0
                with self._cv:
                    if payload is not None:
                        self._pending_bytes -= payload.numel() * payload.element_size()
                    for key in tags:
                        left = self._queued_keys.pop(key) - 1
                        if left:
                            self._queued_keys[key] = left
                    self._busy = 0
                    self._active = False
                    self._cv.notify_all()

    def _store(self, keys: list[bytes], payload: torch.Tensor, tenant: str, group: int | None) -> None:
        try:  # a key stored meanwhile (another engine) is only refreshed by put
            self.store.put(keys, payload, tenant=tenant, group=group)
            self.num_demoted += len(keys)
        except (KVStoreError, TierFullError):  # the store is full: pinned or in-flight blocks, a full disk
            self.num_dropped += len(keys)
