"""The REST app (FastAPI factory) over a daemon's registry or one embedded TieredStore.

``create_app`` includes one router per group of routes, each built by a function of its own
module over the registry: the read routes (rest_reads.py: dashboard, health, metrics, tiers,
stats, lookup, blocks, namespaces), the cache-management routes (rest_cache.py:
``/v1/cache/*``, ``/v1/admin/flush`` and the deprecated admin aliases) and the tenant routes
(rest_tenants.py: usage and quotas). What they share (the field types, the token
dependencies) is rest_common.py. Auth is there too; every endpoint is in docs/rest.md.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from kvstore.services.common.tokens import Tokens
from kvstore.services.daemon.registry import Registry
from kvstore.services.daemon.rest_cache import cache_router
from kvstore.services.daemon.rest_reads import reads_router
from kvstore.services.daemon.rest_tenants import tenants_router
from kvstore.store import TieredStore


def create_app(target: Registry | TieredStore, admin_token: str | None = None, daemon: Any = None,
               tokens: Tokens | None = None) -> FastAPI:
    """The REST app over a daemon's registry, or over one embedded store.

    Args:
        target: a daemon Registry, or a TieredStore (its keys are used unscoped).
        admin_token: the token /v1/admin/* needs (embedded use; a daemon's registry knows it).
        daemon: the Daemon, for its connection and request counters (optional).
        tokens: tenant tokens for an embedded store (default: open, tenant "").
    """
    registry = Registry.embedded(target, tokens or Tokens(admin_token, None)) if isinstance(target, TieredStore) else target
    app = FastAPI(title="kvstore", version="1", description="Tiers, hit rates, lookups and admin of a kvstore.")
    app.state.registry = registry  # the token dependencies find it here (rest_common.py)
    app.include_router(reads_router(registry, daemon))
    app.include_router(tenants_router(registry))
    app.include_router(cache_router(registry))
    return app
