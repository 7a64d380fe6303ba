"""The worker side: loads from kvstore into vLLM's blocks, saves vLLM's blocks to kvstore.

Synchronous loads (the step's forward needs them) start in ``start_load_kv`` and are copied
in layer by layer as ``wait_for_layer_load`` asks; asynchronous loads are fetched on the
transfer thread, copied into every layer by ``get_finished`` on vLLM's own thread once the
fetch is done, and reported in ``finished_recving`` there. (Copying on the transfer thread
cost a GIL hand-over per torch call while vLLM's loop runs Python: ~0.4 s for 24 layers on
the CPU.) Saves gather each layer into a staging buffer of their own as ``save_kv_layer``
hands it over (so vLLM's blocks are free to be reused once the step ends), and
``wait_for_save`` hands them to a saver thread: the put (and a daemon's write-through to disk)
never delays the step. At most MAX_PENDING_SAVES wait. Loads and saves take warm staging
buffers, given back once nothing reads or writes them any more (PagedKV.take_staging). A
block a load could not deliver (corrupt, vanished, store down) is reported by
``load_errors`` and vLLM recomputes it; ``report`` then tells the scheduler which steps'
synchronous loads that output settles (it plans no save over their blocks until then, see
scheduler.py).

A hybrid model's loads and saves carry entries of several KV groups: a layer's copies touch
only its own group's entries and block ids (vLLM's groups share memory, a block id belonging
to one group at a time). Its loads are asynchronous, and one that falls short fails whole: the
request is reported in ``failed_recving`` (``get_finished``) and vLLM recomputes it. A save puts
each group's blocks under that group, then cools the blocks the scheduler named.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvstore.integrations.vllm.backend import GuardedStore
from kvstore.integrations.vllm.counters import COUNTERS, save_finished, save_started
from kvstore.integrations.vllm.metadata import KVStoreMetadata, KVStoreWorkerMeta, LoadSpec, SaveSpec
from kvstore.integrations.vllm.paged import PagedKV
from kvstore.results import FetchHandle

logger = logging.getLogger("kvstore.vllm")
MAX_PENDING_SAVES = 8  # beyond this, wait_for_save waits for the oldest (bounded staging memory)


@dataclass
class _Load:
    spec: LoadSpec
    buffer: torch.Tensor  # a warm staging buffer, given back once the fetch and the scatters are done
    handle: FetchHandle
    runs: list[tuple[int, slice, torch.Tensor]]  # (group, entries, their vLLM block ids)
    delivered: int | None = None  # set once the fetch is waited for
    layers_done: set[str] = field(default_factory=set)

    @property
    def staging(self) -> torch.Tensor:
        return self.buffer[: len(self.spec.keys)]


@dataclass
class _Save:
    spec: SaveSpec
    buffer: torch.Tensor  # a warm staging buffer (PagedKV.take_staging), given back after the put
    runs: list[tuple[int, slice, torch.Tensor]]
    layers_needed: frozenset[str]
    layers_done: set[str] = field(default_factory=set)

    @property
    def staging(self) -> torch.Tensor:
        return self.buffer[: len(self.spec.keys)]


def _runs(spec: LoadSpec | SaveSpec) -> list[tuple[int, slice, torch.Tensor]]:
    return [(g, entries, torch.tensor(spec.block_ids[entries], dtype=torch.long)) for g, entries in spec.runs()]


class WorkerSide:
    """One per worker-side connector; vLLM calls it from one thread, transfers use others.

    ``group_layers``: per KV group, its attention layers in slot order (identity.py).
    """

    def __init__(self, store: GuardedStore, group_layers: Sequence[Sequence[str]], layer_bytes: int) -> None:
        self.store = store
        self.group_layers = tuple(tuple(names) for names in group_layers)
        self.layer_names = tuple(name for names in self.group_layers for name in names)
        self.group_of = {name: g for g, names in enumerate(self.group_layers) for name in names}
        self.is_hybrid = store.layout.is_hybrid
        self.sliding = frozenset(g for g, group in enumerate(store.layout.kv_groups) if group.window is not None)
        self.layer_bytes = layer_bytes
        self.paged: PagedKV | None = None
        self._loads: list[_Load] = []
        self._saves: list[_Save] = []
        self._lock = threading.Lock()
        self._fetched: list[_Load] = []  # async loads whose fetch is done, not yet copied in
        self._errors: set[int] = set()
        self._failed: set[str] = set()  # a hybrid model's requests whose load fell short
        self._pending_async = 0
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvstore-vllm-save")
        self._pending_saves: deque[Future[None]] = deque()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        slots = {name: slot for names in self.group_layers for slot, name in enumerate(names)}
        self.paged = PagedKV(kv_caches, self.layer_names, self.store.layout, self.layer_bytes, slots)

    # ------------------------------------------------------------------------ loads

    def start_load_kv(self, meta: KVStoreMetadata) -> None:
        if self.paged is None:
            return
        for spec in meta.loads:
            # a hybrid model's failed load can only be reported as a failed asynchronous receive
            assert spec.is_async or not self.is_hybrid, f"a synchronous load of a hybrid model ({spec.req_id})"
            buffer = self.paged.take_staging(len(spec.keys))
            load = _Load(spec, buffer, self.store.fetch(spec.keys, buffer[: len(spec.keys)]), _runs(spec))
            if spec.is_async:
                with self._lock:
                    self._pending_async += 1
                COUNTERS.add(async_loads=1)
                load.handle.add_done_callback(functools.partial(self._finish_async, load))
            else:
                self._loads.append(load)

    def _settle(self, load: _Load) -> int:
        """Wait for the fetch; record what it did not deliver. The blocks usable: the ones
        delivered, or none of a hybrid model's short load (the request fails as a whole, see
        scheduler.py)."""
        if load.delivered is None:
            total = len(load.spec.keys)
            delivered = load.handle.result().num_blocks
            if self.is_hybrid and delivered < total:
                logger.warning("kvstore: request %s: %d of %d group blocks could not be loaded; vLLM recomputes "
                               "the request", load.spec.req_id, total - delivered, total)
                COUNTERS.add(load_errors=total)
                with self._lock:
                    self._failed.add(load.spec.req_id)
                delivered = 0
            else:
                failed = load.spec.block_ids[delivered:]
                if failed:
                    logger.warning("kvstore: request %s: %d of %d blocks could not be loaded; vLLM recomputes them",
                                   load.spec.req_id, len(failed), total)
                    with self._lock:
                        self._errors.update(failed)
                window = sum(min(e.stop, delivered) - e.start for g, e, _ in load.runs
                             if g in self.sliding and e.start < delivered)
                COUNTERS.add(loaded_blocks=delivered, load_errors=len(failed), loaded_window_blocks=window,
                             loaded_bytes=delivered * self.store.layout.bytes_per_block)
            load.delivered = delivered
        return load.delivered

    def _scatter(self, load: _Load, layer: str, n: int) -> None:
        """Copy the first ``n`` entries' parts of ``layer`` (those of its group) into vLLM's blocks."""
        assert self.paged is not None
        g = self.group_of[layer]
        for group, entries, block_ids in load.runs:
            stop = min(entries.stop, n)
            if group == g and stop > entries.start:
                self.paged.scatter_layer(layer, block_ids[: stop - entries.start], load.staging[entries.start : stop])

    def _finish_async(self, load: _Load, _handle: FetchHandle | None = None) -> None:
        """The transfer thread's end of an async load: only hand it over (see the module)."""
        with self._lock:
            self._fetched.append(load)

    def _copy_in_async(self, load: _Load) -> None:
        """Copy a fetched async load into every layer, on vLLM's thread."""
        assert self.paged is not None
        try:
            n = self._settle(load)
            with torch.inference_mode():  # vLLM's caches are inference tensors
                for layer in self.layer_names:
                    self._scatter(load, layer, n)
        except Exception as exc:  # the fetch or the copy failed: every block of the load is recomputed
            logger.warning("kvstore: async load for %s failed: %s", load.spec.req_id, exc)
            with self._lock:
                if self.is_hybrid:
                    self._failed.add(load.spec.req_id)
                else:
                    self._errors.update(load.spec.block_ids)
        self._give_back(load.buffer)  # the fetch is done (it was handed over), and so are the copies
        with self._lock:
            self._pending_async -= 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.paged is None or layer_name not in self.paged.layer_index:
            return
        for load in self._loads:
            if layer_name not in load.layers_done:
                self._scatter(load, layer_name, self._settle(load))
                load.layers_done.add(layer_name)

    # ------------------------------------------------------------------------ saves

    def _new_save(self, spec: SaveSpec) -> _Save:
        assert self.paged is not None
        buffer = self.paged.take_staging(len(spec.keys))
        runs = _runs(spec)
        slots = self.store.layout.num_layers
        for g, entries, _ in runs:  # a padded group's last slots: zeros, not a reused buffer's bytes
            if len(self.group_layers[g]) < slots:
                buffer[entries.start : entries.stop, len(self.group_layers[g]) :].zero_()
        needed = frozenset(name for g, _, _ in runs for name in self.group_layers[g])
        return _Save(spec, buffer, runs, needed)

    def save_kv_layer(self, layer_name: str, meta: KVStoreMetadata) -> None:
        if self.paged is None or layer_name not in self.paged.layer_index or not meta.saves:
            return
        started = time.perf_counter_ns()
        if not self._saves:
            self._saves = [self._new_save(s) for s in meta.saves]
        g = self.group_of[layer_name]
        for save in self._saves:
            for group, entries, block_ids in save.runs:
                if group == g:
                    self.paged.gather_layer(layer_name, block_ids, save.staging[entries])
            save.layers_done.add(layer_name)
        COUNTERS.add(save_ns=time.perf_counter_ns() - started)

    def wait_for_save(self) -> None:
        """Finish the step: queue every fully gathered save, and drop the step's loads."""
        # A sync load whose layers were never asked for still reports what it missed. Settled,
        # its fetch is done, and so is the step's forward: no one uses its buffer any more.
        for load in self._loads:
            self._settle(load)
            self._give_back(load.buffer)
        self._loads = []
        started = time.perf_counter_ns()
        saves, self._saves = self._saves, []
        for save in saves:
            if not save.layers_needed <= save.layers_done:
                COUNTERS.add(save_skipped=len(save.spec.keys))
                self._give_back(save.buffer)
                continue
            save_started()
            self._pending_saves.append(self._saver.submit(self._put, save))
        while self._pending_saves and (self._pending_saves[0].done()
                                       or len(self._pending_saves) > MAX_PENDING_SAVES):
            self._pending_saves.popleft().result()
        COUNTERS.add(save_ns=time.perf_counter_ns() - started)

    def _put(self, save: _Save) -> None:
        """Put each group's blocks, then cool what the scheduler named (on the saver thread)."""
        try:
            for g, entries, _ in save.runs:
                keys = save.spec.keys[entries]
                ok = self.store.try_put(keys, save.staging[entries], g if self.is_hybrid else None)
                COUNTERS.add(**{"saved_blocks" if ok else "save_skipped": len(keys)})
            for chain in save.spec.cool:
                COUNTERS.add(cooled_blocks=self.store.cool(list(chain)))
        finally:
            self._give_back(save.buffer)  # the put has copied the blocks out (every store's put does)
            save_finished()

    def _give_back(self, buffer: torch.Tensor) -> None:
        assert self.paged is not None
        self.paged.give_staging(buffer)

    # ------------------------------------------------------------------------ reports

    def get_finished(self) -> tuple[set[str], set[str]]:
        """The requests whose asynchronous load is done (copied in, or failed), and of those the
        ones that failed (a hybrid model's short loads: vLLM recomputes them whole)."""
        with self._lock:
            fetched, self._fetched = self._fetched, []
        for load in fetched:
            self._copy_in_async(load)
        done = {load.spec.req_id for load in fetched}
        with self._lock:
            failed = self._failed & done
            self._failed -= failed
        return done, failed

    def load_errors(self) -> set[int]:
        """Blocks not delivered since the last call, every synchronous load of this step's included
        (settled here too: vLLM may ask before ``wait_for_save`` when it defers that call)."""
        for load in self._loads:
            self._settle(load)
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def report(self, meta: KVStoreMetadata) -> KVStoreWorkerMeta | None:
        """The step's report to the scheduler, after ``load_errors``: its synchronous loads are
        settled, their errors in the same output. From the metadata alone, so that every rank
        reports every such step, whatever happened to its loads."""
        return KVStoreWorkerMeta(frozenset({meta.step})) if meta.has_sync_loads else None

    def shutdown(self) -> None:
        for load in self._loads:
            load.handle.wait(5.0)
        self._loads = []
        self._saver.shutdown(wait=True)  # queued saves reach the store before it closes
