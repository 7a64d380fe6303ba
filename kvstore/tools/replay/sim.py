"""The replay loop: a trace through one tier or a device -> host -> disk cascade of real policies.

Tiers here are plain key sets with a capacity in blocks; the eviction policy objects are the
very classes ``TieredStore`` uses. Per request (see docs/eviction.md):

1. Lookup: walk the chain from its root; each block's best tier is the topmost holding it.
   The hits are the leading run of found blocks (the walk stops at the first miss), credited
   to their best tiers. A request longer than the top tier is cut to its capacity.
2. Lower-tier hits are fetched: their copy there counts as a use (an ``access``) and stays
   (tiers are inclusive, like TieredStore's disk under a host copy).
3. The top tier makes room for the blocks it lacks: each victim (never one of this request's
   blocks: they are in use) is demoted to the next tier unless that tier already holds it, and
   so on down; the last tier drops its victims.
4. The top tier then holds the whole chain: segments it had are accessed, the others inserted,
   segment by segment from the tail, so every policy sees the chain's tail touched first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.eviction import EvictionPolicy, Key
from kvstore.tools.replay.belady import BeladyPolicy, FutureIndex
from kvstore.tools.replay.trace import Trace


@dataclass(frozen=True)
class TierSpec:
    """One tier of the replayed cascade: a name and a capacity in blocks."""

    name: str
    capacity_blocks: int


@dataclass
class ReplayResult:
    """What one policy did on one tier configuration."""

    policy: str
    tiers: tuple[TierSpec, ...]
    num_requests: int
    prompt_blocks: int
    hits: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    read_blocks: dict[str, int] = field(default_factory=dict)  # fetched up from this tier
    written_blocks: dict[str, int] = field(default_factory=dict)  # demoted into this tier
    dropped_blocks: int = 0  # left the last tier
    seconds: float = 0.0

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.prompt_blocks if self.prompt_blocks else 0.0


def policy_factory(name: str, trace: Trace, top_capacity: int) -> tuple[Callable[[], EvictionPolicy],
                                                                       FutureIndex | None]:
    """A per-tier policy factory by name; ``belady`` also returns the clock the replay moves."""
    from kvstore.eviction import make_policy

    if name == BeladyPolicy.name:
        future = FutureIndex([chain[:top_capacity] for chain in trace.chains])
        return (lambda: BeladyPolicy(future)), future
    make_policy(name)  # ValueError listing the known names
    return (lambda: make_policy(name)), None


def _not_in(keys: frozenset[Key]) -> Callable[[Key], bool]:
    def can_evict(key: Key) -> bool:
        return key not in keys

    return can_evict


def replay(trace: Trace, tiers: Sequence[TierSpec], policy: str,
           progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Replay ``trace`` through ``tiers`` (top first), one ``policy`` instance per tier."""
    started = time.perf_counter()
    factory, future = policy_factory(policy, trace, tiers[0].capacity_blocks)
    policies = [factory() for _ in tiers]
    caps = [t.capacity_blocks for t in tiers]
    sizes = [0] * len(tiers)
    num_tiers = len(tiers)
    where: dict[Key, int] = {}  # key -> bit mask of the tiers holding it (bit 0 = top)
    parents: dict[Key, Key | None] = trace.parents  # type: ignore[assignment]
    hits_by_tier = [0] * num_tiers
    reads = [0] * num_tiers
    writes = [0] * num_tiers
    dropped = hits = 0

    def make_room(tier: int, count: int, can_evict: Callable[[Key], bool] | None) -> None:
        # Victims come tail first; the next tier gets them as one batch in chain order.
        nonlocal dropped
        victims = [policies[tier].pop_victim(can_evict) for _ in range(count)]
        assert None not in victims, f"tier {tiers[tier].name}: nothing evictable at {sizes[tier]} blocks"
        sizes[tier] -= count
        below = tier + 1
        demoted: list[Key] = []
        for victim in victims:
            mask = where[victim] & ~(1 << tier)
            if below < num_tiers and not mask >> below & 1 and len(demoted) < caps[below]:
                demoted.append(victim)  # the tier below keeps a copy
                mask |= 1 << below
            if mask:
                where[victim] = mask
            else:
                del where[victim]
                dropped += 1
        if demoted:
            overflow = sizes[below] + len(demoted) - caps[below]
            if overflow > 0:
                make_room(below, overflow, None)
            demoted.reverse()
            policies[below].insert(demoted, [parents.get(v) for v in demoted])
            sizes[below] += len(demoted)
            writes[below] += len(demoted)

    top, top_cap = policies[0], caps[0]
    for request, chain in enumerate(trace.chains):
        if future is not None:
            future.now = request
        keys = chain if len(chain) <= top_cap else chain[:top_cap]
        masks = [where.get(k, 0) for k in keys]
        n = len(keys)
        found = 0
        while found < n and masks[found]:
            mask = masks[found]
            hits_by_tier[(mask & -mask).bit_length() - 1] += 1
            found += 1
        hits += found
        if num_tiers > 1:  # fetch lower-tier hits: one access per tier, in chain order
            fetched: dict[int, list[Key]] = {}
            for i in range(found):
                if not masks[i] & 1:
                    tier = (masks[i] & -masks[i]).bit_length() - 1
                    fetched.setdefault(tier, []).append(keys[i])
            for tier, fetched_keys in fetched.items():
                policies[tier].access(fetched_keys)
                reads[tier] += len(fetched_keys)
        in_top = [m & 1 for m in masks]
        need = n - sum(in_top)
        if sizes[0] + need > top_cap:
            # this request's blocks are in use: never victims
            make_room(0, sizes[0] + need - top_cap, _not_in(frozenset(keys)))
        end = n
        while end > 0:  # segments of the chain, tail first
            start, held = end - 1, in_top[end - 1]
            while start > 0 and in_top[start - 1] == held:
                start -= 1
            segment = keys[start:end]
            if held:
                top.access(segment)
            else:
                top.insert(segment, [keys[start - 1] if start else None, *segment[:-1]])
                for key in segment:
                    where[key] = where.get(key, 0) | 1
                sizes[0] += len(segment)
            end = start
        if progress is not None and request & 255 == 255:
            progress(256)
    if progress is not None:
        progress(len(trace.chains) & 255)
    names = [t.name for t in tiers]
    return ReplayResult(
        policy, tuple(tiers), trace.num_requests, trace.num_blocks, hits,
        dict(zip(names, hits_by_tier, strict=True)), dict(zip(names, reads, strict=True)),
        dict(zip(names, writes, strict=True)), dropped, time.perf_counter() - started,
    )
