"""A hybrid model's prefix hit (kvstore/engine/groups.py): where each group's blocks of the
hit come from, and what the hit is once the fetches are done.

Admission of a sequence over a prompt of N full blocks (chain keys ``keys``):

  1. presence: a group's block i is present when a device block cached under ``keys[i]``
     holds that group (``Block.valid``), or the store holds the group's key for it. Full
     groups ask the store for the run after the device's (one lookup each); sliding groups
     ask only about the windows ``reconcile`` tries (one lookup per window tried; usually
     one). Where the fetch policy declines the lower tiers, only the device counts.
  2. the hit: ``DeviceGroups.reconcile``, the longest boundary n every group serves.
  3. the plan: block i < n is the cached device block where there is one (its missing groups
     fetched into it: the same key means the same KV, and the layers written are ones no
     reader of it reads), else a fresh one; per group, the (index, block, group key) to fetch.

Once the fetches are done, the hit is reconciled again over what really arrived (a fetch may
deliver a shorter run: evicted meanwhile, a corrupt block), so a sequence never starts from a
block a group it needs lacks. Blocks past the final hit are released and recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.api import BlockStore
from kvstore.engine.block_manager import BlockManager
from kvstore.engine.fetcher import Fetcher, finish_groups, start_groups
from kvstore.engine.groups import DeviceGroups
from kvstore.engine.sequence import Sequence as Seq


@dataclass
class GroupHit:
    """A planned hit at boundary ``n``: per block i < n its device block (``cached[i]``: the
    device's own, else None and a fresh one is allocated), the groups it needs, and per group
    the block indices to fetch from the store."""

    n: int
    cached: list[int | None]
    needs: list[int]
    fetch: list[list[int]] = field(default_factory=list)

    @property
    def num_fresh(self) -> int:
        return sum(1 for b in self.cached if b is None)


class Presence:
    """Which group blocks of a prompt can be had, from the device and (asked lazily) the store."""

    def __init__(self, groups: DeviceGroups, blocks: BlockManager, store: BlockStore | None,
                 keys: Sequence[bytes], use_store: bool) -> None:
        self.groups, self.blocks, self.store, self.keys = groups, blocks, store, list(keys)
        self.use_store = use_store and store is not None
        self.cached = blocks.cached_ids(keys)
        self._store: list[dict[int, bool]] = [{} for _ in range(groups.num_groups)]
        self._group_keys: dict[int, list[bytes]] = {}
        self.tiers: dict[tuple[int, int], str] = {}  # (group, index) -> the tier a lookup found it in
        self.num_lookups = 0

    def on_device(self, g: int, i: int) -> bool:
        block = self.cached[i]
        return block is not None and bool(self.blocks.blocks[block].valid >> g & 1)

    def group_keys(self, g: int) -> list[bytes]:
        if g not in self._group_keys:
            assert self.store is not None
            self._group_keys[g] = self.store.group_keys(self.keys, g)
        return self._group_keys[g]

    def in_store(self, g: int, i: int, span: int) -> bool:
        """Whether the store holds group g's block i, asking (one lookup) about blocks
        ``i - span + 1 .. i`` if it was not asked yet."""
        known = self._store[g]
        if i not in known:
            start = max(0, i - span + 1)
            self._ask(g, start, i + 1)
        return known.get(i, False)

    def full_run(self, g: int, n_max: int) -> int:
        """How many leading blocks of full group g the device and the store have together."""
        run = 0
        while run < n_max and self.on_device(g, run):
            run += 1
        if run < n_max and self.use_store:
            run += self._ask(g, run, n_max)
        return run

    def _ask(self, g: int, start: int, stop: int) -> int:
        """Look group g's blocks ``start..stop`` up; the leading run the store has."""
        assert self.store is not None
        self.num_lookups += 1
        found = self.store.lookup(self.group_keys(g)[start:stop])
        known = self._store[g]
        for j, tier in enumerate(found.tiers):
            known[start + j] = True
            self.tiers[(g, start + j)] = tier
        if start + found.num_blocks < stop:
            known[start + found.num_blocks] = False
        return found.num_blocks

    def present(self, g: int, i: int) -> bool:
        if self.on_device(g, i):
            return True
        if not self.use_store:
            return False
        span = self.groups.windows[g] or 1
        return self.in_store(g, i, span)


def plan_hit(groups: DeviceGroups, presence: Presence, n_max: int) -> GroupHit:
    """The longest hit every group serves (``reconcile``), and where each of its blocks is from."""
    for g in groups.full_groups:  # full groups first: their runs bound the hit
        n_max = min(n_max, presence.full_run(g, n_max))
    n = groups.reconcile(n_max, presence.present)
    cached = [presence.cached[i] for i in range(n)]
    needs = [groups.needs(n, i) for i in range(n)]
    fetch: list[list[int]] = [[] for _ in range(groups.num_groups)]
    for i in range(n):
        for g in range(groups.num_groups):
            if needs[i] >> g & 1 and not presence.on_device(g, i):
                fetch[g].append(i)
    # a cached block some group is fetched into is acquired like a hit, not reallocated
    return GroupHit(n, cached, needs, fetch)


def reconcile_delivered(groups: DeviceGroups, presence: Presence, hit: GroupHit, delivered: list[int]) -> int:
    """The hit once group g delivered the first ``delivered[g]`` blocks of ``hit.fetch[g]``."""
    got = [set(hit.fetch[g][: delivered[g]]) for g in range(groups.num_groups)]

    def present(g: int, i: int) -> bool:
        return i < hit.n and (presence.on_device(g, i) or i in got[g])

    return groups.reconcile(hit.n, present)


@dataclass
class GroupFetch:
    """A hybrid model's admission while its groups' blocks are fetched: a sequence's
    ``loading`` (``handle``: the GroupLoading, with done() and wait())."""

    handle: Any
    hit: GroupHit
    presence: Presence
    started_s: float


def admit_groups(blocks: BlockManager, fetcher: Fetcher | None, seq: Seq, keys: list[bytes]) -> GroupFetch | bool | None:
    """Admission of a hybrid model's sequence: its hit (the longest boundary every KV group
    serves from the device and the store), its blocks held or allocated, its groups' fetches
    started. None: no room now; a GroupFetch: loading; True: the hit is all on the device
    (``seq.num_cached_tokens`` set)."""
    groups = blocks.groups
    assert groups is not None
    t0 = time.perf_counter()
    store = fetcher.store if fetcher is not None else None
    presence = Presence(groups, blocks, store, keys, use_store=fetcher is not None and fetcher.policy != "never")
    hit = plan_hit(groups, presence, len(keys))
    seq.request.metrics.stages["lookup"] += time.perf_counter() - t0
    held = [b for b in hit.cached if b is not None]
    if blocks.num_reusable(held) + hit.num_fresh + 1 > blocks.num_available:
        return None
    blocks.acquire(held)
    demoted = blocks.demote_s
    fresh = iter(sorted(blocks.allocate(hit.num_fresh)))
    seq.request.metrics.stages["demote"] += blocks.demote_s - demoted
    seq.block_table = [b if b is not None else next(fresh) for b in hit.cached]
    if any(hit.fetch):
        assert fetcher is not None
        wants = [[(i, seq.block_table[i], presence.group_keys(g)[i]) for i in hit.fetch[g]]
                 for g in range(groups.num_groups)]
        return GroupFetch(start_groups(fetcher, groups, wants), hit, presence, time.perf_counter())
    seq.num_cached_tokens = hit.n * blocks.block_size
    seq.hit_blocks = hit.n
    if seq.request.first_pass:
        seq.request.metrics.cached_tokens["device"] += seq.num_cached_tokens
    return True


def finish_group_fetch(blocks: BlockManager, fetcher: Fetcher | None, seq: Seq) -> None:
    """A hybrid model's fetch done: the hit reconciled over what arrived, the blocks past it
    released, the fresh ones before it sealed with the groups they hold, the cached ones
    filled in; ``seq.num_cached_tokens`` set."""
    assert fetcher is not None and blocks.groups is not None
    groups, loading = blocks.groups, seq.loading
    assert isinstance(loading, GroupFetch)
    hit, presence = loading.hit, loading.presence
    tiers = finish_groups(fetcher, groups, loading.handle)
    n = reconcile_delivered(groups, presence, hit, [len(t) for t in tiers])
    got: dict[int, int] = {}  # block index -> groups delivered into it
    tier_of: dict[int, str] = {}
    for g in range(groups.num_groups):
        for i, tier in zip(hit.fetch[g], tiers[g], strict=False):
            got[i] = got.get(i, 0) | 1 << g
            tier_of.setdefault(i, tier)
    blocks.release(seq.block_table[n:])  # past the hit: recomputed
    del seq.block_table[n:]
    bs = blocks.block_size
    for i in range(n):
        block = blocks.blocks[seq.block_table[i]]
        if hit.cached[i] is not None:  # the device's block: the fetched groups fill it in
            block.valid |= got.get(i, 0)
        elif seq.request.params.writes_prefix_cache:
            blocks.seal(seq.block_table[i], seq.block_keys[i], seq.block_keys[i - 1] if i else None,
                        seq.request.tenant, seq.token_ids[i * bs : (i + 1) * bs], computed=False, valid=got.get(i, 0))
    seq.num_cached_tokens = n * bs
    seq.hit_blocks = n
    metrics = seq.request.metrics
    if seq.request.first_pass:
        for i in range(n):
            tier = tier_of.get(i, "device")
            metrics.cached_tokens[tier] = metrics.cached_tokens.get(tier, 0) + bs
    handle = loading.handle
    metrics.loading_s += max(handle.finished_s[0] - loading.started_s, 0.0) if handle.finished_s else 0.0
    metrics.stages["fetch"] += time.perf_counter() - loading.started_s - handle.copy_s
    metrics.stages["device_copy"] += handle.copy_s


def cool_below_windows(blocks: BlockManager, seq: Seq) -> None:
    """A hybrid model's sequence is done: each sliding group's blocks below its window at the
    end of the prompt (boundary n, its last full block) serve only hits at earlier
    boundaries, so the store evicts them first; but not those in the window of the boundary
    its hit was at (a boundary that was used).

    n is the prompt's end, not the output's: a follow-up turn resends the prompt, but its
    copy of the output may tokenize otherwise (a chat template's end of turn), and a hit
    anywhere from n on then still finds every window it needs."""
    groups = blocks.groups
    if groups is None or groups.trivial or not seq.request.params.writes_prefix_cache:
        return
    n = min(seq.request.num_prompt_tokens, seq.num_cached_tokens) // blocks.block_size
    n = min(n, len(seq.block_keys))
    for g in groups.sliding_groups:
        used = range(groups.window_start(g, seq.hit_blocks), seq.hit_blocks)
        cold = [seq.block_keys[i] for i in range(groups.window_start(g, n)) if i not in used]
        blocks.cool(cold, g)
