"""Cache-aware routing: which replica holds which prefix, and where each request should go.

A library with no HTTP in it (docs/routing.md): ``PrefixIndex`` (block key -> {replica:
tiers}, fed by KV events), ``RoutingHistory`` (the router's own guesses: pending prefixes and
approximate mode), ``scoring`` (cost, overload gate, pick) and ``Router``, which ties them
together. ``kvstore bench route`` (kvstore.tools.bench.route) replays a trace through it
(kvstore.tools.replay.route_sim).
"""

from __future__ import annotations

from kvstore.services.router.policy.config import (
    CACHE_AWARE,
    LEAST_LOADED,
    POLICIES,
    ROUND_ROBIN,
    RoutingError,
    RoutingPolicyConfig,
)
from kvstore.services.router.policy.index import PrefixIndex, PrefixMatches
from kvstore.services.router.policy.keytable import KeyTable, key_ids
from kvstore.services.router.policy.router import Decision, LoadReport, ReplicaState, Router
from kvstore.services.router.policy.tiers import CPU, DISK, GPU, MEDIA, REMOTE, ROUTED, TierWeights

__all__ = [
    "CACHE_AWARE",
    "CPU",
    "DISK",
    "GPU",
    "LEAST_LOADED",
    "MEDIA",
    "POLICIES",
    "REMOTE",
    "ROUND_ROBIN",
    "ROUTED",
    "Decision",
    "KeyTable",
    "LoadReport",
    "PrefixIndex",
    "PrefixMatches",
    "ReplicaState",
    "Router",
    "RoutingError",
    "RoutingPolicyConfig",
    "TierWeights",
    "key_ids",
]


def __getattr__(name: str) -> object:
    """``RouterConfig``: the old name of ``RoutingPolicyConfig`` (warns; see its module)."""
    if name == "RouterConfig":
        from kvstore.services.router.policy import config

        return config.RouterConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
