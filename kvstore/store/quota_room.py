"""HostQuota: tenants' hard quotas in host RAM, as the store's writes and reads meet them.

The quotas themselves (a ``QuotaTable``) and each level's per-tenant accounting (its
``TenantPolicy``) are pure policy (kvstore/policy/). What the store adds is here:

- **room**: a put whose new host blocks would take its tenant past its hard quota first makes
  room among that tenant's own least valuable host blocks (``room_for``: its own policy's
  victims, demoted as any); what still does not fit is refused and counted. A read promotes
  only what the quota allows (``promotion_room``); the rest is read without a host copy.
- **claims**: blocks on their way into host RAM outside the lock (a write-through put's, a
  read's promotions) are claimed against their tenant's quota until they land or are given
  up, so that concurrent puts never pass the quota by one block.

Every method expects the store lock held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.policy.quotas import QuotaTable
from kvstore.store.index import BlockEntry
from kvstore.store.levels.base import Level
from kvstore.store.levels.host_level import HostLevel


class HostQuota:
    """The quotas in force over one store's levels, and the host blocks claimed against them.

    Args:
        levels: the store's indexed levels (rank 0 is host RAM).
        make_room: ``make_room(rank, n, tenant)``: the cascade's demotion, evicting up to ``n``
            of ``tenant``'s blocks from level ``rank``.
    """

    def __init__(self, levels: Sequence[Level], make_room: Callable[[int, int, str | None], None]) -> None:
        self.levels = levels
        self.host: HostLevel = levels[0]  # type: ignore[assignment]
        self._make_room = make_room
        self.table = QuotaTable()
        self.claims: dict[str, int] = {}

    def set(self, table: QuotaTable) -> None:
        """Put ``table`` in force: each level's policy gets its soft and hard limits in blocks
        (kvstore/policy/quotas.py); a level with no quota keeps one shared order."""
        self.table = table
        for level in self.levels:
            policy = level.tenant_policy()
            if policy is not None:
                policy.set_limits(*table.limits(level.name, level.num_slots, level.slot_bytes))

    def capped(self, tenant: str) -> bool:
        """Whether ``tenant`` has a hard quota in host RAM."""
        policy = self.host.tenants
        return policy is not None and tenant in policy.hard

    def room_for(self, tenant: str, n: int, refuse: bool = True) -> int:
        """How many of ``n`` blocks new to host RAM ``tenant`` may place there under its hard
        quota: past it, the tenant's own least valuable host blocks make room first; what still
        does not fit (its blocks there pinned or being read) is refused, and counted (with
        ``refuse``: a put's). Its claimed blocks count as held. The caller holds the blocks it
        is placing, and those of the same chain host holds, as being read."""
        policy = self.host.tenant_policy()
        cap = policy.hard.get(tenant) if policy is not None else None
        if cap is None or policy is None:
            return n
        claimed = self.claims.get(tenant, 0)
        over = policy.counts.get(tenant, 0) + claimed + n - cap
        if over > 0:
            self._make_room(0, over, tenant)
            over = policy.counts.get(tenant, 0) + claimed + n - cap
        fits = max(0, min(n, n - over))
        if fits < n and refuse:
            policy.counters.row(tenant).refused += n - fits
        return fits

    def promotion_room(self, entries: Sequence[BlockEntry]) -> int:
        """How many leading ``entries`` a read may promote into host RAM within their tenants'
        hard quotas (``room_for``, no refusal counted: the rest are read without a host copy)."""
        policy = self.host.tenant_policy()
        if policy is None or not policy.hard or not entries:
            return len(entries)
        wanted: dict[str, int] = {}
        for entry in entries:
            wanted[entry.tenant] = wanted.get(entry.tenant, 0) + 1
        allowed = {t: self.room_for(t, n, refuse=False) if t in policy.hard else n for t, n in wanted.items()}
        for i, entry in enumerate(entries):
            allowed[entry.tenant] -= 1
            if allowed[entry.tenant] < 0:
                return i
        return len(entries)

    def claim_entries(self, entries: Sequence[BlockEntry], release: bool = False) -> dict[str, int]:
        """``claim`` (or with ``release``, ``unclaim``) one host block of each entry's tenant;
        the counts per tenant."""
        counts: dict[str, int] = {}
        for entry in entries:
            counts[entry.tenant] = counts.get(entry.tenant, 0) + 1
        for tenant, n in counts.items():
            (self.unclaim if release else self.claim)(tenant, n)
        return counts

    def claim(self, tenant: str, n: int) -> None:
        """``n`` host blocks of ``tenant`` are on their way in outside the lock: held, for its
        hard quota, until ``unclaim``."""
        if n:
            self.claims[tenant] = self.claims.get(tenant, 0) + n

    def unclaim(self, tenant: str, n: int) -> None:
        if n:
            left = self.claims[tenant] - n
            assert left >= 0, f"tenant {tenant!r} unclaims more host blocks than it claimed"
            if left:
                self.claims[tenant] = left
            else:
                del self.claims[tenant]
