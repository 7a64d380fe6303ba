"""TenantPolicy: one tier's eviction policy, knowing whose blocks it orders.

Every indexed level's policy is one of these around the configured policy (``lru``,
``reuse``): it knows each block's tenant, so it counts what every tenant holds in the tier,
and under quotas it makes the quota-aware victim choice. It is still the one policy of the
tier: ``Cascade.make_room`` asks it for victims as before; there is no second eviction path.

Two modes:

- **shared** (no quota on the tier): one policy instance orders every block, exactly as
  without this wrapper; the wrapper only keeps ``key -> tenant`` and the counts.
- **partitioned** (some quota on the tier): one policy instance per tenant. The victim comes
  from the tenant fullest relative to its soft quota, ``blocks / soft limit`` (a tenant with
  no soft quota, or a zero one, counts as infinitely full: it has no claim to protection),
  ties to the tenant holding more; inside that tenant its own policy picks (tails first,
  reuse protection, ...). So tenants over their soft quota lose blocks first, the most over
  first, and a tenant under its quota loses blocks only when no tenant is over.
  ``pop_victim_of(tenant)`` takes a victim from one tenant (a put at its hard quota makes room
  among its own blocks: ``HostQuota.room_for``, kvstore/store/quota_room.py).

Switching modes (quotas set on a tier that had none, or all removed) rebuilds the order:
recency is kept, approximately across tenants; what a ``reuse`` policy learned (reuse
classes, horizon) starts over.

Evictions caused: every eviction from the tier leaves room (``debt``) that the next blocks
inserted take; the tenant whose blocks take it is counted as having caused it. Without a
tenant on the call that made room (a daemon reserves host slots before a commit names the
tenant), this is the tenant whose blocks filled the room.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from kvstore.policy.eviction import EvictionPolicy, Key
from kvstore.policy.tenant_counters import TenantTable


class TenantPolicy(EvictionPolicy):
    """A tier's policy over its tenants (see the module docstring).

    Args:
        factory: makes one instance of the configured policy (one per tenant when partitioned).
        owner: a block's tenant, asked when it is inserted (the block index's entry).
        on_touch: told the keys of every insert and access (the access sketch of TinyLFU).
    """

    name = "tenants"

    def __init__(self, factory: Callable[[], EvictionPolicy], owner: Callable[[Key], str],
                 on_touch: Callable[[Sequence[Key]], None] | None = None) -> None:
        self._factory = factory
        self.owner = owner
        self.on_touch = on_touch
        self._shared: EvictionPolicy | None = factory()
        self.policy_name = self._shared.name
        self._parts: dict[str, EvictionPolicy] = {}
        self._owners: dict[Key, str] = {}
        self.counts: dict[str, int] = {}  # blocks per tenant
        self.soft: dict[str, int] = {}  # soft quota per tenant, in blocks (partitioned)
        self.hard: dict[str, int] = {}  # hard quota per tenant, in blocks
        self.counters = TenantTable()
        self.debt = 0  # evictions whose room no block has taken yet

    @property
    def partitioned(self) -> bool:
        return self._shared is None

    def set_limits(self, soft: Mapping[str, int] | None, hard: Mapping[str, int] | None = None) -> None:
        """Quotas of this tier in blocks; None and no hard limit: shared mode."""
        partition = soft is not None or bool(hard)
        self.soft, self.hard = dict(soft or {}), dict(hard or {})
        if partition != self.partitioned:
            self._rebuild(partition)

    def tenant_of(self, key: Key) -> str | None:
        return self._owners.get(key)

    # ----------------------------------------------------------------------------- EvictionPolicy

    def insert(self, keys: Sequence[Key], parents: Sequence[Key | None]) -> None:
        if not keys:
            return
        tenants = list(map(self.owner, keys))
        self._owners.update(zip(keys, tenants, strict=True))
        first = tenants[0]
        if tenants.count(first) == len(tenants):  # one chain, one tenant: the common case
            self._add(first, keys, parents)
        else:
            for tenant, (ks, ps) in _groups(keys, parents, tenants).items():
                self._add(tenant, ks, ps)
        if self.on_touch is not None:
            self.on_touch(keys)

    def _add(self, tenant: str, keys: Sequence[Key], parents: Sequence[Key | None]) -> None:
        self._policy(tenant).insert(keys, parents)
        self.counts[tenant] = self.counts.get(tenant, 0) + len(keys)
        if self.debt:
            paid = min(self.debt, len(keys))
            self.debt -= paid
            self.counters.row(tenant).evictions_caused += paid

    def access(self, keys: Sequence[Key]) -> None:
        if self._shared is not None:
            self._shared.access(keys)
        else:
            owners = self._owners
            tracked = [k for k in keys if k in owners]
            tenants = [owners[k] for k in tracked]
            if tenants and tenants.count(tenants[0]) == len(tenants):
                self._parts[tenants[0]].access(tracked)
            elif tenants:
                for tenant, (ks, _) in _groups(tracked, [None] * len(tracked), tenants).items():
                    self._parts[tenant].access(ks)
        if self.on_touch is not None:
            self.on_touch(keys)

    def remove(self, key: Key) -> None:
        tenant = self._owners.get(key)
        if tenant is not None:
            self._policy(tenant).remove(key)
            self._forget(key, tenant)

    def cool(self, keys: Sequence[Key]) -> None:
        if self._shared is not None:
            self._shared.cool(keys)
            return
        owners = self._owners
        tracked = [k for k in keys if k in owners]
        for tenant, (ks, _) in _groups(tracked, [None] * len(tracked), [owners[k] for k in tracked]).items():
            self._parts[tenant].cool(ks)

    def pop_victim(self, can_evict: Callable[[Key], bool] | None = None) -> Key | None:
        if self._shared is not None:  # the common case, kept short: one policy, one order
            key = self._shared.pop_victim(can_evict)
            if key is not None:
                self._forget(key, self._owners[key])
            return key
        for policy in self._victim_order():
            key = policy.pop_victim(can_evict)
            if key is not None:
                self._forget(key, self._owners[key])
                return key
        return None

    def peek_victim(self, can_evict: Callable[[Key], bool] | None = None) -> Key | None:
        for policy in self._victim_order():
            key = policy.peek_victim(can_evict)
            if key is not None:
                return key
        return None

    def pop_victim_of(self, tenant: str, can_evict: Callable[[Key], bool] | None = None) -> Key | None:
        """The next victim among ``tenant``'s blocks only (its own policy's choice)."""
        if self._shared is not None:  # no quota here: a filtered walk of the one order
            owners = self._owners
            key = self._shared.pop_victim(lambda k: owners.get(k) == tenant and (can_evict is None or can_evict(k)))
        else:
            policy = self._parts.get(tenant)
            key = policy.pop_victim(can_evict) if policy is not None else None
        if key is not None:
            self._forget(key, tenant)
        return key

    def __len__(self) -> int:
        return len(self._owners)

    def __contains__(self, key: object) -> bool:
        return key in self._owners

    # ----------------------------------------------------------------------------- internals

    def note_evicted(self, tenants: Iterable[str]) -> None:
        """The cascade evicted blocks of ``tenants`` (one name per block) from this tier."""
        for tenant in tenants:
            self.counters.row(tenant).evictions_suffered += 1
            self.debt += 1

    def _victim_order(self) -> list[EvictionPolicy]:
        """The policies to ask for a victim, in order: the one shared policy, or the tenants'
        from the fullest relative to its soft quota (no quota: infinitely full), ties to the
        larger."""
        if self._shared is not None:
            return [self._shared]
        soft, parts = self.soft, self._parts
        ranked = sorted(((n / soft[t] if soft.get(t, 0) > 0 else float("inf"), n, t)
                         for t, n in self.counts.items() if n > 0), reverse=True)
        return [parts[t] for _, _, t in ranked]

    def _policy(self, tenant: str) -> EvictionPolicy:
        if self._shared is not None:
            return self._shared
        policy = self._parts.get(tenant)
        if policy is None:
            policy = self._parts[tenant] = self._factory()
        return policy

    def _forget(self, key: Key, tenant: str) -> None:
        del self._owners[key]
        left = self.counts[tenant] - 1
        if left:
            self.counts[tenant] = left
        else:
            del self.counts[tenant]

    def _rebuild(self, partition: bool) -> None:
        """Move every block into the other mode's policies, least valuable first, so each
        policy's order (within a tenant exactly, across tenants by relative position) stays."""
        ranked: list[tuple[float, Key]] = []
        for policy in [self._shared] if self._shared is not None else list(self._parts.values()):
            assert policy is not None
            drained: list[Key] = []
            while (key := policy.pop_victim()) is not None:
                drained.append(key)
            ranked += [(i / len(drained), key) for i, key in enumerate(drained)]
        ranked.sort(key=lambda item: item[0])
        self._shared = None if partition else self._factory()
        self._parts = {}
        for _, key in ranked:
            self._policy(self._owners[key]).insert([key], [None])

    def check_integrity(self) -> None:
        owners = self._owners
        assert sum(self.counts.values()) == len(owners), "tenant counts disagree with the tracked blocks"
        seen: dict[str, int] = {}
        for tenant in owners.values():
            seen[tenant] = seen.get(tenant, 0) + 1
        assert seen == self.counts, f"tenant counts {self.counts} != tracked {seen}"
        policies = [self._shared] if self._shared is not None else list(self._parts.values())
        assert sum(len(p) for p in policies if p is not None) == len(owners), "a policy tracks other blocks"
        for key, tenant in owners.items():
            assert key in self._policy(tenant), "a block is missing from its tenant's policy"
        for policy in policies:
            assert policy is not None
            policy.check_integrity()


def _groups(keys: Sequence[Key], parents: Sequence[Key | None], tenants: Sequence[str],
            ) -> dict[str, tuple[list[Key], list[Key | None]]]:
    """``keys`` and ``parents`` split by tenant, each group in the order given."""
    out: dict[str, tuple[list[Key], list[Key | None]]] = {}
    for key, parent, tenant in zip(keys, parents, tenants, strict=True):
        group = out.setdefault(tenant, ([], []))
        group[0].append(key)
        group[1].append(parent)
    return out
