"""Who may manage whose blocks, and forgetting a tenant in every namespace of the daemon.

One home per management operation on the daemon's side: these rules are here; the block
protocol's handlers are kvstore/services/daemon/manage_ops.py and REST's routes
kvstore/services/daemon/rest_cache.py, and both ask here:

- ``acting_tenant``: a tenant token acts on its own tenant only; the admin token (and an
  open daemon's anonymous caller, who is tenant ``""``) may name another. Naming a tenant
  the daemon does not know is refused (``UnknownTenant``): known means named by a token, or
  seen making requests since the daemon started, or holding blocks.
- ``forget_everywhere``: ``TieredStore.forget_tenant`` on every namespace's store, the
  counts summed per tier.
"""

from __future__ import annotations

from typing import Any

from kvstore.services.common.tokens import Principal
from kvstore.services.daemon.registry import Registry


class NotAllowed(Exception):
    """A tenant token named another tenant (REST 403, the protocol's AUTH)."""


class UnknownTenant(KeyError):
    """A tenant the daemon does not know (REST 404, the protocol's NOT_FOUND)."""

    def __str__(self) -> str:
        return str(self.args[0])


def known_tenants(registry: Registry) -> set[str]:
    """Tenants a token names, or that made requests since the daemon started."""
    found = set(registry.tokens.tenants) | {""}
    for state in registry.namespaces():
        found |= set(list(state.counters))
    return found


def is_known(registry: Registry, tenant: str) -> bool:
    if tenant in known_tenants(registry):
        return True
    return any(state.store.view.held_keys(tenant) for state in registry.namespaces())


def acting_tenant(registry: Registry, who: Principal, asked: str | None) -> str:
    """The tenant a management call acts on: ``asked`` if ``who`` may, else its own.

    Raises:
        NotAllowed: a tenant token named another tenant.
        UnknownTenant: the admin named a tenant the daemon does not know.
    """
    if asked is None or asked == who.tenant:
        return who.tenant
    if not (who.admin or registry.tokens.is_open):
        raise NotAllowed(f"this token's tenant is {who.tenant!r}; acting on tenant {asked[:80]!r} needs the "
                         "admin token")
    if not isinstance(asked, str) or not is_known(registry, asked):
        raise UnknownTenant(f"unknown tenant {str(asked)[:80]!r}: no token names it, it made no request since "
                            "the daemon started, and it holds no block")
    return asked


def forget_everywhere(registry: Registry, tenant: str) -> dict[str, Any]:
    """Forget ``tenant`` in every namespace; the reports summed (per tier, blocks, pins)."""
    deleted: dict[str, int] = {}
    num_blocks = pins = 0
    failures: list[str] = []
    for state in registry.namespaces():
        report = state.store.forget_tenant(tenant)
        for tier, n in report.deleted.items():
            deleted[tier] = deleted.get(tier, 0) + n
        num_blocks += report.num_blocks
        pins += report.pins_released
        failures += [f for f in report.failures if f not in failures]
    return {"tenant": tenant, "deleted": deleted, "num_blocks": num_blocks, "pins_released": pins,
            "complete": not failures, "failures": failures, "namespaces": len(registry.namespaces())}
