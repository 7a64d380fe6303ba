"""The replay loop: a trace through one tier or a cascade of tiers of real policies.

Tiers here are plain key sets with a capacity in blocks; the eviction policy objects are the
very classes ``TieredStore`` uses (with tenants, each wrapped in the store's ``TenantPolicy``,
quotas and all), and so are the admission policies. Per request (see docs/eviction.md):

1. Lookup: walk the chain from its root; each block's best tier is the topmost holding it.
   The hits are the leading run of found blocks (the walk stops at the first miss), credited
   to their best tiers. A request longer than the top tier is cut to its capacity.
2. Lower-tier hits are fetched: their copy there counts as a use (an ``access``) and stays
   (tiers are inclusive, like TieredStore's disk under a host copy).
3. The top tier makes room for the blocks it lacks: each victim (never one of this request's
   blocks: they are in use) is demoted to the next tier if that tier lacks it and its
   admission policy takes it, and so on down; the last tier drops its victims. Under a hard
   quota in the top tier, the request's tenant first makes room among its own blocks there,
   and its blocks that still do not fit (tails first) are refused.
4. The top tier then holds the whole chain: segments it had are accessed, the others inserted,
   segment by segment from the tail, so every policy sees the chain's tail touched first.

Admission inputs are the store's: a block's use count (requests that touched it while some
tier held it; one dropped and asked again counts twice, from a ghost list, ``SeenOnce``)
and an access sketch fed every request's blocks. A tier marked ``shared`` (a remote tier)
shows admission no victim, as Redis's own eviction shows the store none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.policy.admission import AdmissionPolicy, AdmitAll, SeenOnce, TinyLFU, make_admission
from kvstore.policy.eviction import EvictionPolicy, Key
from kvstore.policy.quotas import QuotaTable
from kvstore.policy.sketch import FrequencySketch
from kvstore.policy.tenant_policy import TenantPolicy
from kvstore.tools.replay.belady import BeladyPolicy, FutureIndex
from kvstore.tools.replay.trace import Trace


@dataclass(frozen=True)
class TierSpec:
    """One tier of the replayed cascade: a name, a capacity in blocks, the admission policy of
    the blocks demoted into it (not the top tier's), and whether it is shared (remote)."""

    name: str
    capacity_blocks: int
    admission: str = "all"
    shared: bool = False


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
    quotas: str = "none"  # the quota setting's label
    hits_by_tenant: dict[str, int] = field(default_factory=dict)
    blocks_by_tenant: dict[str, int] = field(default_factory=dict)  # prompt blocks per tenant
    refused_blocks: int = 0  # blocks a hard quota refused

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def admission(self) -> str:
        """The admission of the tiers below the top, as one label ("all", "disk=tinylfu", ...)."""
        below = [f"{t.name}={t.admission}" for t in self.tiers[1:] if t.admission != "all"]
        return ",".join(below) or "all"

    def tenant_hit_ratios(self) -> dict[str, float]:
        return {t: self.hits_by_tenant.get(t, 0) / n if n else 0.0 for t, n in self.blocks_by_tenant.items()}


def policy_factory(name: str, trace: Trace, top_capacity: int) -> tuple[Callable[[], EvictionPolicy],
                                                                       FutureIndex | None]:
    """A per-tier policy factory by name; ``belady`` also returns the clock the replay moves."""
    from kvstore.policy.eviction import make_policy

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
           progress: Callable[[int], None] | None = None, quotas: QuotaTable | None = None,
           quota_label: str = "none", block_bytes: int = 1) -> ReplayResult:
    """Replay ``trace`` through ``tiers`` (top first), one ``policy`` instance per tier (per
    tenant under quotas); ``quotas`` in blocks of ``block_bytes`` where given in bytes."""
    started = time.perf_counter()
    factory, future = policy_factory(policy, trace, tiers[0].capacity_blocks)
    tenanted = bool(trace.tenants) and future is None
    owners: dict[Key, str] = trace.owners  # type: ignore[assignment]

    def owner(key: Key) -> str:
        return owners.get(key, "")

    parts: list[TenantPolicy | None] = [TenantPolicy(factory, owner) if tenanted else None for _ in tiers]
    policies: list[EvictionPolicy] = [p if p is not None else factory() for p in parts]
    hard: dict[str, int] = {}
    if quotas is not None and tenanted:
        for spec, part in zip(tiers, parts, strict=True):
            assert part is not None
            part.set_limits(*quotas.limits(spec.name, spec.capacity_blocks, block_bytes))
        hard = parts[0].hard if parts[0] is not None else {}
    sketch = FrequencySketch(max(t.capacity_blocks for t in tiers)) \
        if any(t.admission == TinyLFU.name for t in tiers[1:]) else None
    admissions: list[AdmissionPolicy] = [make_admission(t.admission, sketch) for t in tiers]
    caps = [t.capacity_blocks for t in tiers]
    sizes = [0] * len(tiers)
    num_tiers = len(tiers)
    where: dict[Key, int] = {}  # key -> bit mask of the tiers holding it (bit 0 = top)
    uses: dict[Key, int] = {}  # held keys' use counts (seen_twice admission)
    ghost = SeenOnce()  # dropped keys, remembered as seen once
    parents: dict[Key, Key | None] = trace.parents  # type: ignore[assignment]
    hits_by_tier = [0] * num_tiers
    reads = [0] * num_tiers
    writes = [0] * num_tiers
    hits_by_tenant: dict[str, int] = {}
    blocks_by_tenant: dict[str, int] = {}
    dropped = hits = refused = 0

    def admitted(below: int, candidates: list[Key]) -> set[Key]:
        if isinstance(admissions[below], AdmitAll) or not candidates:
            return set(candidates)
        full = sizes[below] + len(candidates) > caps[below]
        victim = policies[below].peek_victim() if full and not tiers[below].shared else None
        flags = admissions[below].admit(candidates, [uses.get(k, 1) for k in candidates], victim, full)
        return {k for k, ok in zip(candidates, flags, strict=True) if ok}

    def make_room(tier: int, count: int, can_evict: Callable[[Key], bool] | None, tenant: str | None = None) -> int:
        # Victims come tail first; the next tier gets them as one batch in chain order.
        nonlocal dropped
        part = parts[tier]
        if tenant is not None and part is not None:
            popped = [part.pop_victim_of(tenant, can_evict) for _ in range(count)]
            victims = [v for v in popped if v is not None]
        else:
            victims = [policies[tier].pop_victim(can_evict) for _ in range(count)]
            assert None not in victims, f"tier {tiers[tier].name}: nothing evictable at {sizes[tier]} blocks"
        sizes[tier] -= len(victims)
        below = tier + 1
        takes = admitted(below, [v for v in victims if not where[v] >> below & 1]) if below < num_tiers else set()
        demoted: list[Key] = []
        for victim in victims:
            mask = where[victim] & ~(1 << tier)
            if victim in takes and len(demoted) < caps[below]:
                demoted.append(victim)  # the tier below keeps a copy
                mask |= 1 << below
            if mask:
                where[victim] = mask
            else:
                del where[victim]
                dropped += 1
                uses.pop(victim, None)
                ghost.add(victim)
        if demoted:
            overflow = sizes[below] + len(demoted) - caps[below]
            if overflow > 0:
                make_room(below, overflow, None)
            demoted.reverse()
            policies[below].insert(demoted, [parents.get(v) for v in demoted])
            sizes[below] += len(demoted)
            writes[below] += len(demoted)
        return len(victims)

    top, top_cap = policies[0], caps[0]
    for request, chain in enumerate(trace.chains):
        if future is not None:
            future.now = request
        tenant = trace.tenants[request] if trace.tenants else ""
        keys = chain if len(chain) <= top_cap else chain[:top_cap]
        if sketch is not None:
            sketch.add(keys)
        masks = [where.get(k, 0) for k in keys]
        n = len(keys)
        found = 0
        while found < n and masks[found]:
            mask = masks[found]
            hits_by_tier[(mask & -mask).bit_length() - 1] += 1
            found += 1
        hits += found
        hits_by_tenant[tenant] = hits_by_tenant.get(tenant, 0) + found
        blocks_by_tenant[tenant] = blocks_by_tenant.get(tenant, 0) + len(chain)
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
        cap = hard.get(tenant)
        if cap is not None and need:
            assert parts[0] is not None
            over = parts[0].counts.get(tenant, 0) + need - cap
            if over > 0:  # its own blocks make room first, then its tails are refused
                over -= make_room(0, over, _not_in(frozenset(keys)), tenant)
            if over > 0:
                keep, fresh = n, 0
                for i, held in enumerate(in_top):
                    fresh += not held
                    if fresh > need - over:
                        keep = i
                        break
                refused += n - keep - sum(in_top[keep:])
                keys, in_top = keys[:keep], in_top[:keep]
                n, need = keep, need - over
        for key in keys:
            count = uses.get(key)
            uses[key] = count + 1 if count is not None else 2 if key in ghost else 1
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
        quota_label, hits_by_tenant, blocks_by_tenant, refused,
    )
