"""The scheduler side: which tokens kvstore holds for a request, and each step's loads and saves.

Per request it keeps the chained keys of its full blocks (prompt first, then generated
tokens as blocks fill), the vLLM block ids, and how many leading blocks the store is known
to hold. A load covers the blocks kvstore holds beyond vLLM's own prefix-cache hit; a save
covers each block the request has computed that the store does not hold yet, so a request's
blocks are in kvstore as soon as they are computed (a finished request leaves nothing to do).

A block computed while a synchronous load it may read from is unconfirmed is not saved yet:
if that load missed a block on any rank, the forward attended to a block nobody filled, and
the result (wrong KV under the right key) would stay in the store, which keeps the first copy
of a key. Such a load's blocks stay "in doubt" from the step that runs it until the worker's
report of that step comes back (``KVStoreWorkerMeta``, in the output that carries the step's
load errors from every rank, after vLLM has rewound the requests they touch); until then a
request whose blocks include one in doubt plans no save. The first step after that saves what
it computed meanwhile (from vLLM's blocks, still the request's) or, after a miss, what vLLM
recomputes. A request that finishes while in doubt leaves those blocks unsaved (a future miss).
Prompt-embedding requests are neither looked up nor saved: their token ids are placeholders.

A hybrid model (KV groups, kvstore/layout.py; vLLM's hybrid KV cache manager on) is looked up,
loaded and saved per group (groups.py): the hit is the longest boundary every group serves; a
load fetches each group's blocks beyond vLLM's own hit that the group needs (a sliding window's
only), a save each group's blocks vLLM still holds, and once a sliding group's blocks fall
below the window (and outside the window the request's own hit used) the worker cools them in
the store after its put. Its loads are always asynchronous: vLLM 0.32 takes a failed load of a
model of several KV cache groups only as a failed asynchronous receive (``failed_recving``, the
request recomputed); a block id reported as a load error stops its scheduler.

Per-request settings vLLM carries are honoured: ``skip_reading_prefix_cache`` (vLLM's own
SamplingParams field) asks nothing of the store and loads nothing; ``kv_transfer_params``
(vLLM's per-request dict for the connector, e.g. the OpenAI body's ``kv_transfer_params``)
with ``{"kvstore": {"store": false}}`` saves none of the request's blocks ("do not store").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import DaemonUnreachableError
from kvstore.integrations.vllm.backend import GuardedStore
from kvstore.integrations.vllm.counters import COUNTERS
from kvstore.integrations.vllm.groups import GroupLookup, cold_blocks, live_start, load_blocks, window_of
from kvstore.integrations.vllm.metadata import KVStoreMetadata, LoadSpec, SaveSpec
from kvstore.keys import ExtraKey

logger = logging.getLogger("kvstore.vllm")


@dataclass
class _Tracked:
    request: Any  # vLLM's Request (its all_token_ids grow as tokens are sampled)
    salt: str | None  # vLLM's cache_salt
    is_cacheable: bool = True  # False: prompt embeddings (token ids are placeholders), never keyed
    tenant: str | None = None  # the chain's tenant (GuardedStore.tenant_for), once known
    keys: list[bytes] | None = None  # keys of the full blocks hashed so far; None: store down
    num_held: int = 0  # leading blocks the store holds (from the lookup, then our saves)
    tiers: tuple[str, ...] = ()
    num_local_tokens: int = 0  # vLLM's own prefix-cache hit when the lookup ran
    is_async: bool = False  # the planned load runs outside the step
    loading: frozenset[int] = frozenset()  # vLLM block ids of the last planned load
    load_failed: bool = False  # a load missed blocks: never plan another (no retry loop)
    saves: bool = True  # False: the request said "do not store" (kv_transfer_params)
    block_ids: list[list[int]] = field(default_factory=list)  # per KV group, vLLM's block table
    hit_blocks: int = 0  # the boundary its hit ended at, vLLM's or a load's (the window there was used)
    cooled: dict[int, int] = field(default_factory=dict)  # sliding group -> blocks before this considered


class SchedulerSide:
    """Lookups and per-step metadata; one per scheduler-side connector."""

    def __init__(self, store: GuardedStore, block_size: int, async_tiers: tuple[str, ...],
                 load: bool = True, save: bool = True, async_when_idle: bool = False) -> None:
        self.store = store
        self.block_size = block_size
        self.groups = store.layout.kv_groups
        self.is_hybrid = store.layout.is_hybrid
        self.null_block: int | None = None  # vLLM's null block id (a sliding window's freed positions)
        self.async_tiers = async_tiers
        self.async_when_idle = async_when_idle
        self.can_load, self.can_save = load, save
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[LoadSpec] = []
        self._step = 0
        self._in_doubt: dict[int, frozenset[int]] = {}  # step -> vLLM blocks of its sync loads, unconfirmed
        self._doubtful: frozenset[int] = frozenset()  # the union of _in_doubt's blocks

    # --------------------------------------------------------------------------- keys

    def _extra_keys(self, request: Any, first: int, stop: int) -> list[list[ExtraKey] | None] | None:
        """Per block in [first, stop): the LoRA adapter (name and path, as vLLM's own prefix
        cache keys it: a name re-pointed at another adapter never reuses its KV) and the
        multimodal items the block overlaps."""
        lora = getattr(request, "lora_request", None)
        features = getattr(request, "mm_features", None) or []
        if lora is None and not features:
            return None
        b = self.block_size
        adapter: list[ExtraKey] = [] if lora is None else ["lora", lora.lora_name, getattr(lora, "lora_path", "")]
        out: list[list[ExtraKey] | None] = []
        for i in range(first, stop):
            extras = list(adapter)
            for f in features:
                pos = f.mm_position
                if pos.offset < (i + 1) * b and pos.offset + pos.length > i * b:
                    extras += [f"mm:{f.identifier}", pos.offset]
            out.append(extras or None)
        return out

    def _extend_keys(self, t: _Tracked, num_blocks: int) -> list[bytes] | None:
        """Make ``t.keys`` cover ``num_blocks`` full blocks of the request's tokens."""
        b = self.block_size
        if t.tenant is None:
            t.tenant = self.store.tenant_for(t.salt)  # known once the store is up
            if t.tenant is None:
                return None
        if t.keys is None:
            t.keys = []
        have = len(t.keys)
        if num_blocks > have:
            tokens = t.request.all_token_ids[have * b : num_blocks * b]
            parent = t.keys[-1] if t.keys else None
            try:
                more = self.store.block_keys(tokens, t.tenant, self._extra_keys(t.request, have, num_blocks), parent)
            except DaemonUnreachableError:  # the daemon went down: a miss until it is back
                return None
            t.keys += more
        return t.keys

    # ---------------------------------------------------------------------- the hooks

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens kvstore holds beyond ``num_computed_tokens`` (whole blocks), and whether to load
        them asynchronously. The prompt's last token is always left to compute."""
        started = time.perf_counter_ns()
        try:
            return self._matched(request, num_computed_tokens)
        finally:
            COUNTERS.add(lookup_ns=time.perf_counter_ns() - started)

    def _matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        t = self._tracked.get(request.request_id)
        if t is None:
            # A prompt of embeddings (all or some of it) has placeholder token ids: keys of those
            # would name every such prompt alike. It is tracked only to count in-flight requests.
            cacheable = getattr(request, "prompt_embeds", None) is None and request.prompt_token_ids is not None
            t = self._tracked[request.request_id] = _Tracked(request, getattr(request, "cache_salt", None),
                                                             is_cacheable=cacheable, saves=stores(request))
        if not t.is_cacheable or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        usable = (len(request.prompt_token_ids) - 1) // self.block_size
        keys = self._extend_keys(t, usable) if usable > 0 else None
        if keys is None:
            return 0, False
        first = num_computed_tokens // self.block_size
        if self.is_hybrid:
            found = GroupLookup(self.groups, self.block_size, self.store, keys[:usable])
            num_held, hit = found.hit(usable), found.hit(usable, first)
            tiers = found.tiers(hit, first)
        else:
            match = self.store.lookup(keys[:usable])
            num_held, hit, tiers = match.num_blocks, match.num_blocks, match.tiers
        COUNTERS.add(lookups=1, lookup_blocks=usable, hit_blocks=num_held)
        t.num_held, t.tiers = max(t.num_held, num_held), tiers
        t.num_local_tokens, t.hit_blocks = num_computed_tokens, first
        if not self.can_load or t.load_failed or hit <= first:
            return 0, False
        # parked only while other requests are in flight (tracked until request_finished): with
        # none, the load runs inside the step, where nothing else waits for it; a hybrid model's
        # always (see the module)
        others = len(self._tracked) > 1
        t.is_async = self.is_hybrid or ((others or self.async_when_idle)
                                        and any(tier in self.async_tiers for tier in tiers[first:]))
        return (hit - first) * self.block_size, t.is_async

    def hit_tiers(self, request_id: str, num_external_tokens: int) -> dict[str, int]:
        """Tokens per tier ("host", "disk", "remote") of the load planned for the request."""
        t = self._tracked.get(request_id)
        if t is None or num_external_tokens <= 0:
            return {}
        first = t.num_local_tokens // self.block_size
        tiers = t.tiers[first : first + num_external_tokens // self.block_size]
        return {tier: tiers.count(tier) * self.block_size for tier in set(tiers)}

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """Plan the load of the ``num_external_tokens`` promised for the request; ``block_ids``:
        vLLM's block table of each KV group."""
        t = self._tracked.get(request.request_id)
        if t is None or num_external_tokens <= 0 or t.keys is None:
            return
        first = t.num_local_tokens // self.block_size
        stop = first + num_external_tokens // self.block_size
        if stop > min(len(ids) for ids in block_ids) or stop > len(t.keys):
            logger.warning("kvstore: request %s has %d blocks for a load up to block %d; not loading",
                           request.request_id, min(len(ids) for ids in block_ids), stop)
            return
        keys: list[bytes] = []
        ids: list[int] = []
        groups: list[int] = []
        for g, group in enumerate(self.groups):
            wanted = load_blocks(group, self.block_size, first, stop)
            keys += self.store.group_keys(t.keys[wanted.start : wanted.stop], g)
            ids += block_ids[g][wanted.start : wanted.stop]
            groups += [g] * len(wanted)
        if self.null_block is not None and self.null_block in ids:  # vLLM's allocation, not as documented
            logger.warning("kvstore: request %s: vLLM gave its null block for a load up to block %d; not loading",
                           request.request_id, stop)
            return
        t.hit_blocks = stop
        t.loading = frozenset(ids)
        self._loads.append(LoadSpec(request.request_id, keys, ids, t.is_async, tuple(groups) if self.is_hybrid else ()))

    def note_worker_output(self, invalid_block_ids: set[int], sync_load_steps: frozenset[int],
                           failed_req_ids: set[str] | frozenset[str] = frozenset()) -> None:
        """One step's output from every worker: the blocks they could not load and the requests
        whose asynchronous load failed (those requests load nothing more; vLLM recomputes), and
        the steps whose synchronous loads are settled, every error of theirs included (their
        blocks are no longer in doubt)."""
        for req_id, t in self._tracked.items():
            if t.loading & invalid_block_ids or req_id in failed_req_ids:
                t.load_failed = True
        if sync_load_steps & self._in_doubt.keys():
            for step in sync_load_steps:
                self._in_doubt.pop(step, None)
            self._doubtful = frozenset().union(*self._in_doubt.values())

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreMetadata:
        """This step's loads (planned since the last call) and saves (blocks computed and not
        in doubt, see the module)."""
        self._step += 1
        meta = KVStoreMetadata(loads=self._loads, step=self._step)
        self._loads = []
        sync_blocks = frozenset(i for load in meta.loads if not load.is_async for i in load.block_ids)
        if sync_blocks:
            self._in_doubt[self._step] = sync_blocks
            self._doubtful |= sync_blocks
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            t = self._tracked.get(new.req_id)
            if t is not None:
                t.block_ids = [list(ids) for ids in new.block_ids]
                self._plan_save(meta, new.req_id, t, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._tracked.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                t.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                if not t.block_ids:
                    t.block_ids = [[] for _ in new_ids]
                for table, more in zip(t.block_ids, new_ids, strict=True):
                    table += more
            self._plan_save(meta, req_id, t, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
        return meta

    def _plan_save(self, meta: KVStoreMetadata, req_id: str, t: _Tracked, num_computed: int,
                   num_scheduled: int) -> None:
        if not self.can_save or not t.is_cacheable or not t.saves or not t.block_ids:
            return
        b = self.block_size
        # vLLM recomputing blocks the lookup found (a load failed, or they were evicted since):
        # the store lost them, so the step that recomputes them saves them again.
        t.num_held = min(t.num_held, num_computed // b)
        full = min(num_computed + num_scheduled, len(t.request.all_token_ids)) // b
        full = min(full, *(len(ids) for ids in t.block_ids))
        if full <= t.num_held:
            return
        if self._doubtful and any(not self._doubtful.isdisjoint(ids[:full]) for ids in t.block_ids):
            return  # computed over a block an unconfirmed load fills: saved once it is confirmed
        chain = self._extend_keys(t, full)
        if chain is None:
            return
        keys: list[bytes] = []
        ids: list[int] = []
        groups: list[int] = []
        cool: list[tuple[bytes, ...]] = []
        for g, group in enumerate(self.groups):
            # a sliding group's blocks below the window vLLM has freed (its null block stands
            # there, or another request's block may already): never read
            start = max(t.num_held, live_start(group, b, num_computed))
            wanted = [i for i in range(start, full) if group.window is None or t.block_ids[g][i] != self.null_block]
            keys += self.store.group_keys([chain[i] for i in wanted], g)
            ids += [t.block_ids[g][i] for i in wanted]
            groups += [g] * len(wanted)
            w = window_of(group, b)
            if w is not None:
                cold = cold_blocks(group, b, t.cooled.get(g, 0), full, t.hit_blocks)
                t.cooled[g] = max(t.cooled.get(g, 0), full - w)
                if cold:
                    cool.append(tuple(self.store.group_keys([chain[i] for i in cold], g)))
        if keys or cool:
            meta.saves.append(SaveSpec(req_id, keys, ids, tuple(groups) if self.is_hybrid else (), tuple(cool)))
        t.num_held = full

    def request_finished(self, request: Any) -> None:
        """Forget the request: every full block was saved by the step that completed it (and a
        sliding group's blocks below the last window cooled)."""
        self._tracked.pop(request.request_id, None)


def stores(request: Any) -> bool:
    """Whether a request's blocks may be saved: not when its ``kv_transfer_params`` say
    ``{"kvstore": {"store": false}}``. Anything else under "kvstore" (a misspelt option, a
    non-bool) is logged and read as "do not store": a request that asked for privacy keeps it."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or "kvstore" not in params:
        return True
    options = params["kvstore"]
    if isinstance(options, dict) and set(options) <= {"store"} and isinstance(options.get("store", True), bool):
        return bool(options.get("store", True))
    logger.warning("kvstore: request %s: kv_transfer_params['kvstore'] must be {'store': true|false}, got %.80r; "
                   "not storing its blocks", getattr(request, "request_id", "?"), options)
    return False
