"""Router: picks the replica for each request from the prefix index and the replicas' load.

No HTTP here: ``kvstore route`` (the server), ``kvstore bench route`` (the trace replay) and
the tests drive this same object. A request's life in the router:

1. ``route(tokens, tenant)`` hashes the prompt with the replicas' recipe (the tenant salts the
   keys, so tenants never share a prefix) and returns a ``Decision``; ``route_keys`` takes a
   chain already hashed. For a hybrid model (KV groups in the recipe's layout) each group's
   keys of the chain are looked up, and a replica scores its reconciled hit (index.py).
2. The caller sends the request, calls ``prefill_done(decision)`` at its first token and
   ``finished(decision)`` at its end (or on failure): the router's own in-flight counts and
   queued prefill tokens, which cover what the replicas' load reports have not seen yet.
3. Meanwhile the replicas' events arrive as ``stored``/``removed``/``cleared`` and their load
   figures as ``update_load``; ``set_approximate`` follows their heartbeats.

Thread-safe: one lock around every call (each takes microseconds).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.api import KeyChain
from kvstore.events.groups import window_blocks
from kvstore.services.router.policy import scoring
from kvstore.services.router.policy.config import (
    CACHE_AWARE,
    LEAST_LOADED,
    ROUND_ROBIN,
    RoutingError,
    RoutingPolicyConfig,
)
from kvstore.services.router.policy.history import RoutingHistory
from kvstore.services.router.policy.index import PrefixIndex, PrefixMatches
from kvstore.services.router.policy.keytable import key_ids
from kvstore.services.router.policy.tiers import ROUTED, TIERS

ROUTED_COLUMN = TIERS.index(ROUTED)


@dataclass(frozen=True)
class LoadReport:
    """A replica's own load figures (``GET /v1/kvstore/load``); zeros until the first report."""

    queued_prefill_tokens: int = 0
    running_decode_seqs: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int | None = None


@dataclass
class ReplicaState:
    """What the router knows of one replica besides its blocks."""

    name: str
    healthy: bool = True
    in_flight: int = 0  # requests this router sent that have not finished
    prefilling: int = 0  # ... of which have not produced their first token
    routed_prefill_tokens: int = 0  # their predicted uncached prompt tokens
    load: LoadReport = field(default_factory=LoadReport)
    decisions: int = 0
    last_chosen: int = -1  # the router's decision number when this replica was last picked


@dataclass(frozen=True)
class Decision:
    """Where one request goes and why.

    Attributes:
        replica: the chosen replica's name.
        reason: ``cache_hit`` (it holds the most of the prompt), ``pending`` (... as a prefix
            the router sent there that events have not confirmed yet), ``approximate`` (... by
            the router's history of a replica whose events are stale), ``overload_gate`` (the
            replica holding the most was overloaded), ``load`` (its load outweighed the
            replica holding the most), ``no_prefix`` (no replica holds any of it: least cost),
            ``round_robin`` or ``least_loaded`` (those policies).
        prompt_tokens: the prompt's length.
        predicted_cached_tokens: the chosen replica's leading cached run, in tokens.
        predicted_by_tier: that run's blocks by best tier (``ROUTED`` for guesses).
        seconds: time to decide, hashing included.
    """

    replica: str
    reason: str
    prompt_tokens: int
    predicted_cached_tokens: int
    predicted_by_tier: dict[str, int]
    cost: float
    seconds: float
    uncached_tokens: int = field(repr=False, default=0)


class Router:
    """The routing library's front object (see module).

    Args:
        block_tokens: tokens per block (the replicas' block size).
        config: the policy and its weights.
        hasher: the replicas' key recipe (``route`` needs it). A hybrid layout's groups are
            looked up group by group (``group_keys``), by ``route_keys`` too.
    """

    def __init__(self, block_tokens: int, config: RoutingPolicyConfig | None = None,
                 hasher: KeyChain | None = None) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        if hasher is not None and hasher.namespace.layout.block_size != block_tokens:
            raise ValueError(f"the hasher's block size {hasher.namespace.layout.block_size} != "
                             f"block_tokens {block_tokens}")
        self.config = config or RoutingPolicyConfig()
        self.block_tokens = block_tokens
        self.hasher = hasher
        layout = hasher.namespace.layout if hasher is not None else None
        # per KV group, the blocks a hit reads ending at its boundary; None: one full group (a chain)
        self.windows = window_blocks(layout) if layout is not None and layout.is_hybrid else None
        self.index = PrefixIndex(self.config.weights)
        self.history = RoutingHistory(self.index, self.config.pending_ttl_s, self.config.history_blocks)
        self.replicas: dict[str, ReplicaState] = {}
        self.reasons: Counter[str] = Counter()
        self._turn = 0
        self._lock = threading.Lock()

    # -- replicas --------------------------------------------------------------------------
    def add_replica(self, name: str) -> None:
        with self._lock:
            if name not in self.replicas:
                self.replicas[name] = ReplicaState(name)
                self.index.add_replica(name)

    def remove_replica(self, name: str) -> None:
        with self._lock:
            self.history.forget(name)
            self.index.remove_replica(name)
            self.replicas.pop(name, None)

    def set_healthy(self, name: str, healthy: bool) -> None:
        """Take a replica out (it holds nothing any more: index and guesses cleared) or back."""
        with self._lock:
            state = self._state(name)
            if not healthy and state.healthy:
                self.index.cleared(name)
                self.history.forget(name)
            state.healthy = healthy

    def set_approximate(self, name: str, approximate: bool, now: float | None = None) -> None:
        """Events stale (route from history) or fresh again (guesses expire as usual)."""
        with self._lock:
            self._state(name)
            self.history.set_approximate(name, approximate, _now(now))

    def update_load(self, name: str, report: LoadReport) -> None:
        with self._lock:
            self._state(name).load = report

    def _state(self, name: str) -> ReplicaState:
        try:
            return self.replicas[name]
        except KeyError:
            raise KeyError(f"unknown replica {name!r}; known: {sorted(self.replicas)}") from None

    def indexed_blocks(self, name: str) -> dict[str, int]:
        """``index.num_blocks(name)`` under the lock (events may be arriving on other threads)."""
        with self._lock:
            return self.index.num_blocks(name)

    # -- events ----------------------------------------------------------------------------
    def stored(self, name: str, keys: Sequence[bytes], medium: str) -> None:
        with self._lock:
            self.index.stored(name, keys, medium)

    def removed(self, name: str, keys: Sequence[bytes], medium: str) -> None:
        with self._lock:
            self.index.removed(name, keys, medium)

    def cleared(self, name: str, medium: str | None = None) -> None:
        with self._lock:
            self.index.cleared(name, medium)

    # -- routing ---------------------------------------------------------------------------
    def route(self, tokens: Sequence[int] | np.ndarray, tenant: str = "", now: float | None = None) -> Decision:
        """Choose a replica for a prompt of ``tokens`` sent by ``tenant``; RoutingError if none."""
        if self.hasher is None:
            raise RoutingError("this router has no hasher: use route_keys with hashed blocks")
        started = time.perf_counter()
        ids = self._ids(self.hasher.block_keys(tokens, tenant))
        return self._route(ids, len(tokens), started, now)

    def route_keys(self, keys: Sequence[bytes], prompt_tokens: int, now: float | None = None) -> Decision:
        """As ``route``, for a prompt already hashed into its full blocks' (chain) ``keys``."""
        started = time.perf_counter()
        return self._route(self._ids(keys), prompt_tokens, started, now)

    def _ids(self, keys: Sequence[bytes]) -> np.ndarray:
        """The index ids of a chain: ``[blocks]``, or ``[groups, blocks]`` for a hybrid model."""
        if self.windows is None:
            return key_ids(keys)
        assert self.hasher is not None
        return np.stack([key_ids(self.hasher.group_keys(keys, g)) for g in range(len(self.windows))])

    def _route(self, ids: np.ndarray, prompt_tokens: int, started: float, now: float | None) -> Decision:
        policy = self.config.policy
        with self._lock:
            now = _now(now)
            states = [s for s in self.replicas.values() if s.healthy]
            if not states:
                raise RoutingError(f"no healthy replica among {len(self.replicas)}: "
                                   f"{', '.join(sorted(self.replicas)) or 'none registered'}")
            n = len(states)
            start = self._turn % n
            self._turn += 1
            in_flight = np.array([s.in_flight for s in states])
            last_chosen = np.array([s.last_chosen for s in states])
            queued = np.array([max(s.load.queued_prefill_tokens, s.routed_prefill_tokens) for s in states])
            decoding = np.array([max(s.load.running_decode_seqs, s.in_flight - s.prefilling) for s in states])
            free = np.array([np.inf if s.load.num_free_blocks is None else
                             max(0, s.load.num_free_blocks * self.block_tokens - s.routed_prefill_tokens)
                             for s in states])  # the router's own requests will fill some
            if policy == CACHE_AWARE:
                self.history.expire(now)
            match = self.index.match(ids, [s.name for s in states], self.config.shared_remote, self.windows)
            saved = scoring.saved_tokens(match.saved_blocks, self.block_tokens, prompt_tokens)
            saved[match.num_blocks < self.config.min_match * ids.shape[-1]] = 0.0
            if policy == ROUND_ROBIN:
                choice, reason = start, ROUND_ROBIN
                cost = scoring.costs(prompt_tokens, saved, queued, decoding, free, self.config)
            elif policy == LEAST_LOADED:
                cost = scoring.costs(prompt_tokens, np.zeros(n), queued, decoding, np.full(n, np.inf), self.config)
                choice, reason = scoring.pick(cost, in_flight, np.ones(n, bool), last_chosen), LEAST_LOADED
            else:
                cost = scoring.costs(prompt_tokens, saved, queued, decoding, free, self.config)
                allowed = ~scoring.overloaded(in_flight, queued, self.config)
                choice = scoring.pick(cost, in_flight, allowed, last_chosen)
                reason = self._reason(match, saved, allowed, choice, states)
                self.history.record(states[choice].name, ids.ravel(), now)  # every group's keys
            state = states[choice]
            # as the engine counts: every token of the run's whole blocks (a prompt found whole
            # counts all its tokens cached; only its last runs again, for its logits)
            cached = min(int(match.num_blocks[choice]), prompt_tokens // self.block_tokens) * self.block_tokens
            uncached = int(prompt_tokens - saved[choice])
            state.in_flight += 1
            state.prefilling += 1
            state.routed_prefill_tokens += uncached
            state.decisions += 1
            state.last_chosen = self._turn
            self.reasons[reason] += 1
            return Decision(state.name, reason, prompt_tokens, cached,
                            match.tiers_of(choice), float(cost[choice]), time.perf_counter() - started, uncached)

    def _reason(self, match: PrefixMatches, saved: np.ndarray, allowed: np.ndarray, choice: int,
                states: list[ReplicaState]) -> str:
        best = int(np.argmax(saved))
        if saved[best] <= 0:
            return "no_prefix"
        if saved[choice] < saved[best]:
            return "overload_gate" if not allowed[best] else "load"
        if self.history.is_approximate(states[choice].name):
            return "approximate"
        by_tier = match.by_tier[choice]
        return "pending" if by_tier[ROUTED_COLUMN] == by_tier.sum() else "cache_hit"

    def prefill_done(self, decision: Decision) -> None:
        """The request's first token came back: its prefill no longer queues on the replica."""
        with self._lock:
            state = self.replicas.get(decision.replica)
            if state is not None and state.prefilling > 0:
                state.prefilling -= 1
                state.routed_prefill_tokens = max(0, state.routed_prefill_tokens - decision.uncached_tokens)

    def finished(self, decision: Decision, prefill_done: bool = True) -> None:
        """The request ended (or failed); pass ``prefill_done=False`` if it never got a token."""
        if not prefill_done:
            self.prefill_done(decision)
        with self._lock:
            state = self.replicas.get(decision.replica)
            if state is not None and state.in_flight > 0:
                state.in_flight -= 1


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now
