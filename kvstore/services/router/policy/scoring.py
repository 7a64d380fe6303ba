"""The cost of sending one request to each replica, the overload gate, and the pick.

All functions are pure and work on arrays with one entry per candidate replica:

    saved_i  = tokens of the prompt's leading run replica i holds, each block weighted by its
               best tier (tiers.py), at most prompt_tokens - 1 (the last token is computed)
    cost_i   = cache_weight * (prompt_tokens - saved_i) + queued_prefill_i
               + decode_weight * decode_seqs_i + eviction_weight * evicted_i
    evicted_i = max(0, prompt_tokens - saved_i - free device tokens_i): what the request would
               push out of a full cache (other prefixes, recomputed later if reused); 0 where
               the replica does not report its free blocks

The lowest cost wins among the replicas the gate lets through. The gate comes first: a replica
more than ``gate_ratio`` x the mean in-flight requests (or queued prefill tokens) and at least
``gate_min_requests`` (``gate_min_tokens``) above the least loaded one takes nothing new, so a
hot prefix spreads instead of piling onto the replica that cached it first. The least loaded
replica always passes, so some replica always does.
"""

from __future__ import annotations

import numpy as np

from kvstore.services.router.policy.config import RoutingPolicyConfig


def saved_tokens(saved_blocks: np.ndarray, block_tokens: int, prompt_tokens: int) -> np.ndarray:
    """Weighted cached blocks -> prefill tokens saved, capped at ``prompt_tokens - 1``."""
    return np.minimum(saved_blocks * block_tokens, max(prompt_tokens - 1, 0))


def costs(prompt_tokens: int, saved: np.ndarray, queued_tokens: np.ndarray, decode_seqs: np.ndarray,
          free_tokens: np.ndarray, config: RoutingPolicyConfig) -> np.ndarray:
    """What sending the request to each replica costs, in prefill tokens (see module)."""
    uncached = prompt_tokens - saved
    evicted = np.maximum(0.0, uncached - free_tokens)
    return (config.cache_weight * uncached + queued_tokens + config.decode_weight_tokens * decode_seqs
            + config.eviction_weight * evicted)


def overloaded(in_flight: np.ndarray, queued_tokens: np.ndarray, config: RoutingPolicyConfig) -> np.ndarray:
    """The gate: True for each replica that must not take this request (see module)."""
    mean_after = (in_flight.sum() + 1) / in_flight.size  # the mean once this request is placed
    by_count = (in_flight - in_flight.min() >= config.gate_min_requests) & (
        in_flight + 1 > config.gate_ratio * mean_after)
    by_tokens = (queued_tokens - queued_tokens.min() >= max(config.gate_min_tokens, 1)) & (
        queued_tokens > config.gate_ratio * queued_tokens.mean())
    return by_count | by_tokens


def pick(cost: np.ndarray, in_flight: np.ndarray, allowed: np.ndarray, last_chosen: np.ndarray) -> int:
    """The allowed candidate of lowest cost; ties go to fewer in-flight requests, then to the
    one chosen longest ago (``last_chosen``: a decision counter), so equal replicas take turns."""
    order = np.lexsort((last_chosen, in_flight, cost, ~allowed))
    return int(order[0])
