"""A trace through the real Router over simulated replicas: cache hits, load and TTFT in time.

Each simulated replica has one device tier of ``capacity_blocks`` trace blocks ordered by a
real eviction policy (kvstore.policy.eviction), a FIFO prefill queue served at
``prefill_tokens_per_s``, and decodes that run in parallel for ``output_length *
decode_s_per_token``. Requests arrive at their trace timestamps. Per request:

1. Arrival: every replica reports its load (queued prefill tokens, decoding sequences) and
   the Router decides from its index, exactly as ``kvstore route`` does.
2. Prefill start: the replica looks its cache up (leading run of the chain, as the engine's
   scheduler does at admission); the uncached tokens take their time.
3. Prefill end: the chain enters the cache, evicting victims; the replica's ``BlockStored`` /
   ``BlockRemoved`` events reach the Router at once, and the first token is out (TTFT).
4. Decode end: the request finishes.

Once a second every replica's in-flight prefill tokens (queued + the rest of the one running)
are sampled: the load spread is max/min over replicas of their mean.
"""

from __future__ import annotations

import heapq
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvstore.keys import BlockHasher
from kvstore.policy.eviction import DEFAULT_POLICY, EvictionPolicy, make_policy
from kvstore.services.router.policy.config import RoutingPolicyConfig
from kvstore.services.router.policy.keytable import key_ids
from kvstore.services.router.policy.router import Decision, LoadReport, Router
from kvstore.services.router.policy.tiers import GPU
from kvstore.tools.replay.trace import TRACE_NAMESPACE, ReplayError, parse_request

BLOCK_TOKENS = 512  # Mooncake's trace block


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    chain: list[bytes]


def load_requests(path: str | Path) -> list[TraceRequest]:
    """A Mooncake trace with timestamps and lengths; ReplayError for bad lines."""
    hasher = BlockHasher(TRACE_NAMESPACE)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ReplayError(f"cannot read trace {path}: {exc}") from None
    requests = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        ids, length = parse_request(line, where)
        obj = json.loads(line)
        stamp, out = obj.get("timestamp", 0), obj.get("output_length", 1)
        if not isinstance(stamp, int | float) or isinstance(stamp, bool) or stamp < 0:
            raise ReplayError(f"{where}: 'timestamp' must be a non-negative number, got {stamp!r}")
        if type(out) is not int or out < 0:
            raise ReplayError(f"{where}: 'output_length' must be a non-negative integer, got {out!r}")
        tokens = length if length is not None else len(ids) * BLOCK_TOKENS
        requests.append(TraceRequest(stamp / 1000.0, tokens, out, hasher.block_keys(ids)))
    if not requests:
        raise ReplayError(f"trace {path} holds no requests")
    return requests


class DeviceCache:
    """One replica's device tier: a key set of ``capacity`` blocks under a real eviction policy.

    ``admit`` follows kvstore replay's top-tier step (docs/eviction.md): the request's own
    blocks are never victims, and the chain is touched segment by segment from its tail.
    """

    def __init__(self, capacity: int, policy: EvictionPolicy,
                 on_stored: Callable[[list[bytes]], None], on_removed: Callable[[list[bytes]], None]) -> None:
        self.capacity, self.policy = capacity, policy
        self.keys: set[bytes] = set()
        self._on_stored, self._on_removed = on_stored, on_removed

    def lookup(self, chain: list[bytes]) -> int:
        """Length of the leading run of ``chain`` held. Pure query."""
        found = 0
        for key in chain:
            if key not in self.keys:
                break
            found += 1
        return found

    def admit(self, chain: list[bytes]) -> None:
        keys = chain[: self.capacity]
        held = [k in self.keys for k in keys]
        need = len(keys) - sum(held)
        overflow = len(self.keys) + need - self.capacity
        if overflow > 0:
            protected = frozenset(keys)
            victims: list[bytes] = []
            for _ in range(overflow):
                victim = self.policy.pop_victim(lambda k: k not in protected)
                assert isinstance(victim, bytes), f"nothing evictable in a tier of {self.capacity} blocks"
                victims.append(victim)
            self.keys.difference_update(victims)
            self._on_removed(victims)
        stored: list[bytes] = []
        end = len(keys)
        while end > 0:  # segments of the chain, tail first
            start, is_held = end - 1, held[end - 1]
            while start > 0 and held[start - 1] == is_held:
                start -= 1
            segment = keys[start:end]
            if is_held:
                self.policy.access(segment)
            else:
                self.policy.insert(segment, [keys[start - 1] if start else None, *segment[:-1]])
                self.keys.update(segment)
                stored[:0] = segment
            end = start
        if stored:
            self._on_stored(stored)


@dataclass
class _Job:
    request: TraceRequest
    decision: Decision
    estimate: int  # uncached tokens as the replica saw them when it queued the request


@dataclass
class SimReplica:
    name: str
    cache: DeviceCache
    queue: deque[_Job] = field(default_factory=deque)
    running: _Job | None = None
    running_until: float = 0.0
    running_tokens: int = 0
    decoding: int = 0
    samples: list[float] = field(default_factory=list)
    computed_tokens: int = 0

    def queued_tokens(self, now: float, rate: float) -> float:
        left = max(0.0, (self.running_until - now) * rate) if self.running is not None else 0.0
        return left + sum(job.estimate for job in self.queue)


@dataclass(frozen=True)
class SimConfig:
    num_replicas: int = 4
    capacity_blocks: int = 2500
    prefill_tokens_per_s: float = 20_000.0
    decode_s_per_token: float = 0.02
    eviction: str = DEFAULT_POLICY


@dataclass
class SimResult:
    policy: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: list[float]
    samples: np.ndarray  # [replicas, seconds] in-flight prefill tokens
    computed_tokens: list[int]
    reasons: dict[str, int]

    @property
    def cached_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def load_spread(self) -> float:
        """max/min over replicas of the mean in-flight prefill tokens."""
        means = self.samples.mean(axis=1)
        return float(means.max() / means.min()) if means.min() > 0 else float("inf")


def _events_to(router: Router, name: str) -> tuple[Callable[[list[bytes]], None], Callable[[list[bytes]], None]]:
    """A replica's BlockStored / BlockRemoved events for its device tier, delivered at once."""

    def stored(keys: list[bytes]) -> None:
        router.stored(name, keys, GPU)

    def removed(keys: list[bytes]) -> None:
        router.removed(name, keys, GPU)

    return stored, removed


def simulate(requests: list[TraceRequest], config: SimConfig, router_config: RoutingPolicyConfig) -> SimResult:
    """Replay ``requests`` through a Router over ``config.num_replicas`` simulated replicas."""
    router = Router(BLOCK_TOKENS, router_config)
    rate = config.prefill_tokens_per_s
    replicas: list[SimReplica] = []
    for i in range(config.num_replicas):
        name = f"replica-{i}"
        router.add_replica(name)
        stored, removed = _events_to(router, name)
        replicas.append(SimReplica(name, DeviceCache(config.capacity_blocks, make_policy(config.eviction),
                                                     stored, removed)))
    by_name = {r.name: r for r in replicas}
    events: list[tuple[float, int, str, object]] = []  # (time, seq, kind, payload)
    seq = 0

    def push(at: float, kind: str, payload: object) -> None:
        nonlocal seq
        heapq.heappush(events, (at, seq, kind, payload))
        seq += 1

    for request in requests:
        push(request.arrival_s, "arrive", request)
    end_s = requests[-1].arrival_s
    for second in range(int(end_s) + 1):
        push(float(second), "sample", None)
    cached_total = prompt_total = 0
    ttft: list[float] = []

    def start_next(replica: SimReplica, now: float) -> None:
        nonlocal cached_total
        if replica.running is not None or not replica.queue:
            return
        job = replica.queue.popleft()
        req = job.request
        cached = min(replica.cache.lookup(req.chain) * BLOCK_TOKENS, max(req.input_tokens - 1, 0))
        cached_total += cached
        replica.running = job
        replica.running_tokens = req.input_tokens - cached
        replica.computed_tokens += replica.running_tokens
        replica.running_until = now + replica.running_tokens / rate
        push(replica.running_until, "prefilled", replica)

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            req = payload
            assert isinstance(req, TraceRequest)
            for r in replicas:
                router.update_load(r.name, LoadReport(int(r.queued_tokens(now, rate)), r.decoding,
                                                      num_free_blocks=r.cache.capacity - len(r.cache.keys)))
            decision = router.route_keys(req.chain, req.input_tokens, now=now)
            target = by_name[decision.replica]
            cached_now = target.cache.lookup(req.chain) * BLOCK_TOKENS
            target.queue.append(_Job(req, decision, max(req.input_tokens - cached_now, 1)))
            prompt_total += req.input_tokens
            start_next(target, now)
        elif kind == "prefilled":
            replica = payload
            assert isinstance(replica, SimReplica) and replica.running is not None
            job, replica.running = replica.running, None
            replica.cache.admit(job.request.chain)
            router.prefill_done(job.decision)
            ttft.append(now - job.request.arrival_s)
            replica.decoding += 1
            push(now + job.request.output_tokens * config.decode_s_per_token, "finished", (replica, job))
            start_next(replica, now)
        elif kind == "finished":
            assert isinstance(payload, tuple)
            replica, job = payload
            replica.decoding -= 1
            router.finished(job.decision)
        else:
            for r in replicas:
                r.samples.append(r.queued_tokens(now, rate))
    router.index.check_integrity()
    for r in replicas:  # the events kept the index equal to every replica's real block set
        held = router.index.held_ids(r.name, GPU)
        assert held.size == len(r.cache.keys) and set(held.tolist()) == set(
            key_ids(list(r.cache.keys)).tolist()), f"{r.name}: the index disagrees with the cache"
    return SimResult(router_config.policy, prompt_total, cached_total, ttft,
                     np.array([r.samples for r in replicas]), [r.computed_tokens for r in replicas],
                     dict(router.reasons))
