"""RoutingPolicyConfig: every knob of the routing library, frozen and validated."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvstore.services.router.policy.tiers import TierWeights

CACHE_AWARE, ROUND_ROBIN, LEAST_LOADED = "cache_aware", "round_robin", "least_loaded"
POLICIES = (CACHE_AWARE, ROUND_ROBIN, LEAST_LOADED)


class RoutingError(Exception):
    """No replica can take a request (none registered or none healthy); the message says which."""


@dataclass(frozen=True)
class RoutingPolicyConfig:
    """How the router chooses a replica (docs/routing.md explains each term).

    Attributes:
        policy: ``cache_aware`` (prefix affinity vs load), ``round_robin`` or ``least_loaded``.
        weights: the share of a block's prefill a hit in each tier saves.
        min_match: a replica's cached prefix counts only when it covers at least this share of
            the prompt's full blocks (SGLang's cache threshold): a prefix every request shares (a
            system prompt) must not pull every new conversation onto the first replica that
            cached it, while a conversation's later turns (mostly cached) stay where they are.
        cache_weight: how many queued tokens one uncached prompt token is worth. Waiting in a
            queue costs this request; recomputing a prefix cached elsewhere also costs the
            system (the work delays every request queued behind it) and copies the prefix into
            a second cache. 4 is the best of 1-16 on the conversation trace (docs/routing.md).
        decode_weight_tokens: prefill-token equivalents charged per running decode sequence.
        eviction_weight: the cost of each token a request would push out of a full device
            cache (another prefix, recomputed later if it comes back); it keeps a prefix that
            every replica could hold (a system prompt) from pulling everyone onto one replica
            while other caches have room.
        gate_ratio: a replica above this multiple of the mean (in-flight requests, or queued
            prefill tokens) is overloaded and skipped, however much of the prompt it holds...
        gate_min_requests: ...unless it is fewer than this many requests above the least loaded
            replica (counts), or...
        gate_min_tokens: ...fewer than this many queued prefill tokens above it (tokens).
        pending_ttl_s: how long a routed prefix counts as held before the replica's events
            confirm it.
        history_blocks: per replica, the most guesses kept in approximate mode.
        shared_remote: the replicas share one remote tier (one Redis Cluster): a block any of
            them published in ``REMOTE`` can be fetched by every one.
    """

    policy: str = CACHE_AWARE
    weights: TierWeights = field(default_factory=TierWeights)
    cache_weight: float = 4.0
    min_match: float = 0.5
    decode_weight_tokens: float = 16.0
    eviction_weight: float = 4.0
    gate_ratio: float = 1.5
    gate_min_requests: int = 16
    gate_min_tokens: int = 65536
    pending_ttl_s: float = 5.0
    history_blocks: int = 1 << 16
    shared_remote: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not isinstance(self.weights, TierWeights):
            raise ValueError(f"weights must be a TierWeights, got {type(self.weights).__name__}")
        if not isinstance(self.min_match, int | float) or not 0.0 <= self.min_match <= 1.0:
            raise ValueError(f"min_match must be a number in [0, 1], got {self.min_match!r}")
        for name, low in (("cache_weight", 1.0), ("decode_weight_tokens", 0.0),
                          ("eviction_weight", 0.0), ("gate_ratio", 1.0), ("pending_ttl_s", 0.0)):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) \
                    or value < low:
                raise ValueError(f"{name} must be a finite number >= {low}, got {value!r}")
        for name, low in (("gate_min_requests", 1), ("gate_min_tokens", 0), ("history_blocks", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def __getattr__(name: str) -> object:
    """``RouterConfig``, the old name of ``RoutingPolicyConfig`` (it configures the routing
    library, while ``RouteConfig`` configures ``kvstore route``): importable, with a warning."""
    if name == "RouterConfig":
        import warnings

        warnings.warn("RouterConfig is named RoutingPolicyConfig now", DeprecationWarning, stacklevel=2)
        return RoutingPolicyConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
