"""Fetching prefix blocks from the store's lower tiers into device blocks, and the fetch policy.

``fetch_policy="auto"`` fetches the leading run of k lower-tier blocks that maximises
``recompute_time(k) - fetch_time(k)`` when that is positive, where

  fetch_time(k)     = LATENCY_S + sum over the k blocks of bytes_per_block / bandwidth[tier]
  recompute_time(k) = k * block_size / prefill_tokens_per_s

Bandwidths and the prefill rate are exponential moving averages of what this engine measured
(fetch submit to completion; prefill tokens per second of steps that prefilled at least one
block), starting from the documented defaults below until the first measurement.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore import kernels
from kvstore.api import BlockStore
from kvstore.engine.groups import DeviceGroups
from kvstore.results import FetchResult

LATENCY_S = 5e-4  # fixed cost of one fetch: thread hand-off, lookups, the scatter launch
DEFAULT_BANDWIDTH = {"host": 2e9, "disk": 3e8, "remote": 1e9}  # bytes/s until measured (remote: loopback Redis)
SLOWEST_FIRST = ("remote", "disk", "host")  # a mixed fetch is charged to its slowest tier
DEFAULT_PREFILL_RATE = {"cpu": 2e3, "cuda": 2e4}  # tokens/s until measured
EMA = 0.3  # weight of the newest measurement


MAX_DIRECT_RUNS = 8  # a fetch into more runs of adjacent device blocks goes through staging


@dataclass
class Loading:
    """A fetch in flight: ``keys`` land in ``block_ids`` (the sequence's blocks after its device
    hits), straight into the pool (``staging`` None) or into a staging tensor scattered later."""

    handle: Any
    keys: list[bytes]
    block_ids: list[int]
    tiers: tuple[str, ...]
    staging: torch.Tensor | None
    started_s: float
    finished_s: list[float] = field(default_factory=list)
    copy_s: float = 0.0  # the scatter from staging into the pool


class RunsHandle:
    """One fetch handle over several, each filling one run of adjacent device blocks. Its
    result is the leading run delivered: a run counts only after every earlier one in full."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles
        self.num_requested = sum(h.num_requested for h in handles)

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in self.handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h.wait(left):
                return False
        return True

    def result(self, timeout: float | None = None) -> FetchResult:
        tiers: list[str] = []
        for h in self.handles:
            got = h.result(timeout)
            tiers += got.tiers
            if got.num_blocks < h.num_requested:
                break
        return FetchResult(len(tiers), tuple(tiers))

    def add_done_callback(self, fn: Any) -> None:
        left = [len(self.handles)]
        lock = threading.Lock()

        def one_done(_h: Any) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fn(self)

        for h in self.handles:
            h.add_done_callback(one_done)


class Fetcher:
    """Plans, starts and completes fetches for one engine; keeps the running estimates."""

    def __init__(self, store: BlockStore, pool: torch.Tensor, policy: str, block_size: int) -> None:
        self.store = store
        self.pool = pool
        self.policy = policy
        self.block_size = block_size
        self.bytes_per_block = pool[0].numel() * pool.element_size()
        self.bandwidth = dict(DEFAULT_BANDWIDTH)
        self.prefill_rate = DEFAULT_PREFILL_RATE["cuda" if pool.is_cuda else "cpu"]
        self._measured: set[str] = set()  # estimates replaced by a measurement at least once
        self.num_fetched_blocks = 0
        self.num_failed_blocks = 0

    def fetch_time(self, tiers: Sequence[str]) -> float:
        return LATENCY_S + sum(self.bytes_per_block / self.bandwidth[t] for t in tiers) if tiers else 0.0

    def recompute_time(self, num_blocks: int) -> float:
        return num_blocks * self.block_size / self.prefill_rate

    def plan(self, tiers: Sequence[str]) -> int:
        """How many of the leading lower-tier blocks (``tiers`` from a lookup) to fetch."""
        if self.policy == "always":
            return len(tiers)
        if self.policy == "never" or not tiers:
            return 0
        best, best_gain, fetch = 0, 0.0, LATENCY_S
        per_block = self.block_size / self.prefill_rate
        for k, tier in enumerate(tiers, start=1):
            fetch += self.bytes_per_block / self.bandwidth[tier]
            gain = k * per_block - fetch
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def start(self, keys: list[bytes], block_ids: list[int], tiers: tuple[str, ...]) -> Loading:
        """Fetch ``keys`` into device blocks ``block_ids``: straight into the pool, one fetch
        per run of adjacent ids, when there are few runs; else into staging (see finish)."""
        runs = _runs(block_ids)
        loading = Loading(None, keys, block_ids, tiers, None, time.perf_counter())
        if len(runs) <= MAX_DIRECT_RUNS:
            handles = [self.store.fetch(keys[i:j], into=self.pool[first : first + j - i]) for i, j, first in runs]
            loading.handle = handles[0] if len(handles) == 1 else RunsHandle(handles)
        else:
            loading.staging = torch.empty((len(keys), *self.pool.shape[1:]), dtype=self.pool.dtype,
                                          device=self.pool.device)
            loading.handle = self.store.fetch(keys, into=loading.staging)
        loading.handle.add_done_callback(lambda _h: loading.finished_s.append(time.perf_counter()))
        return loading

    def finish(self, loading: Loading) -> tuple[str, ...]:
        """Copy what arrived into the device blocks; returns the tiers of the delivered leading run.

        A failed fetch (I/O error, checksum mismatch, evicted meanwhile) delivers a shorter run,
        possibly empty; the caller recomputes the rest.
        """
        try:
            tiers = tuple(loading.handle.result().tiers)
        except Exception:  # an error inside the transfer thread: recompute everything
            tiers = ()
        n = len(tiers)
        if n:
            if loading.staging is not None:
                t0 = time.perf_counter()
                ids = torch.tensor(loading.block_ids[:n], dtype=torch.long)
                kernels.scatter_blocks(self.pool, ids, loading.staging[:n])
                loading.copy_s = time.perf_counter() - t0
            elapsed = (loading.finished_s[0] if loading.finished_s else time.perf_counter()) - loading.started_s
            self._measure(tiers, elapsed)
        self.num_fetched_blocks += n
        self.num_failed_blocks += len(loading.keys) - n
        return tiers

    def _measure(self, tiers: tuple[str, ...], seconds: float) -> None:
        """Charge the faster tiers of a fetch their estimated share of ``seconds`` and update
        the slowest tier's bandwidth with the rest (the slowest dominates a mixed fetch)."""
        seconds = max(seconds - LATENCY_S, 1e-6)
        slowest = next(t for t in SLOWEST_FIRST if t in tiers)
        others_s = sum(self.bytes_per_block / self.bandwidth[t] for t in tiers if t != slowest)
        num = sum(1 for t in tiers if t == slowest)
        self._update(slowest, num * self.bytes_per_block / max(seconds - others_s, 1e-6))

    def _update(self, tier: str, value: float) -> None:
        self.bandwidth[tier] = self._blend(tier, self.bandwidth[tier], value)

    def _blend(self, name: str, old: float, new: float) -> float:
        if name not in self._measured:  # the first measurement replaces the default outright
            self._measured.add(name)
            return new
        return (1 - EMA) * old + EMA * new

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= self.block_size and seconds > 0:
            self.prefill_rate = self._blend("prefill", self.prefill_rate, num_tokens / seconds)


@dataclass
class GroupLoading:
    """A hybrid model's fetch in flight (kvstore/engine/groups.py): per KV group, the group's
    keys of the blocks it fills, those blocks' indices in the sequence and their device ids,
    fetched into a staging tensor of group blocks and scattered into the group's layers once
    done. ``handles[g]`` is None for a group with nothing to fetch."""

    handles: list[Any]
    keys: list[list[bytes]]
    indices: list[list[int]]
    block_ids: list[list[int]]
    staging: list[torch.Tensor | None]
    started_s: float
    finished_s: list[float] = field(default_factory=list)
    copy_s: float = 0.0

    def done(self) -> bool:
        return all(h is None or h.done() for h in self.handles)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: as long as it takes); True when every group's
        fetch is done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in self.handles:
            if h is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h.wait(left):
                return False
        return True


def start_groups(fetcher: Fetcher, groups: DeviceGroups, wants: list[list[tuple[int, int, bytes]]]) -> GroupLoading:
    """Fetch, per KV group g, ``wants[g]``: ``(block index, device id, group key)`` in block
    order, into staging group blocks (scattered by ``finish_groups``)."""
    layout = groups.layout
    loading = GroupLoading([], [], [], [], [], time.perf_counter())
    for want in wants:
        loading.indices.append([i for i, _, _ in want])
        loading.block_ids.append([b for _, b, _ in want])
        loading.keys.append([k for _, _, k in want])
        if not want:
            loading.handles.append(None)
            loading.staging.append(None)
            continue
        staging = torch.empty((len(want), *layout.block_shape), dtype=layout.dtype, device=fetcher.pool.device)
        loading.staging.append(staging)
        loading.handles.append(fetcher.store.fetch(loading.keys[-1], into=staging))
    pending = [h for h in loading.handles if h is not None]
    left = [len(pending)]
    lock = threading.Lock()

    def one_done(_h: Any) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                loading.finished_s.append(time.perf_counter())

    for h in pending:
        h.add_done_callback(one_done)
    return loading


def finish_groups(fetcher: Fetcher, groups: DeviceGroups, loading: GroupLoading) -> list[tuple[str, ...]]:
    """Scatter what each group delivered into its layers of the device blocks; per group, the
    tiers of its delivered leading run (a failed fetch: a shorter run, possibly empty)."""
    out: list[tuple[str, ...]] = []
    t0 = time.perf_counter()
    for g, handle in enumerate(loading.handles):
        if handle is None:
            out.append(())
            continue
        try:
            tiers = tuple(handle.result().tiers)
        except Exception:  # an error inside the transfer thread: that group delivered nothing
            tiers = ()
        n = len(tiers)
        staging = loading.staging[g]
        if n and staging is not None:
            groups.scatter(fetcher.pool, loading.block_ids[g][:n], g, staging[:n])
        fetcher.num_fetched_blocks += n
        fetcher.num_failed_blocks += len(loading.keys[g]) - n
        out.append(tiers)
    loading.copy_s = time.perf_counter() - t0
    return out


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """``(start, stop, first id)`` of each run of consecutive ids in ``ids``."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, i, ids[start]))
            start = i
    return runs
