"""Trace replay: Mooncake-format traces through kvstore's real eviction policy objects.

``kvstore replay TRACE.jsonl --capacity 1000,2000`` (one tier, a sweep) or ``--device N --host N
--disk N`` (the demotion cascade). Modules: ``trace`` (load, validate, key chains), ``belady``
(the offline optimum as a policy), ``sim`` (the replay loop and its semantics), ``estimate``
(bytes moved, prefill time saved), ``route_sim`` (a trace through the router's policies,
for ``kvstore bench route``), ``hybrid`` (the trace as a hybrid model's KV groups, ``--layout``),
``hybrid_command`` (its runs beside all-full blocks in the same bytes), ``command`` (the CLI).
Semantics: docs/eviction.md.
"""

from __future__ import annotations

from kvstore.tools.replay.belady import BeladyPolicy, FutureIndex
from kvstore.tools.replay.command import register, run
from kvstore.tools.replay.estimate import CostModel, estimate
from kvstore.tools.replay.sim import ReplayResult, TierSpec, replay
from kvstore.tools.replay.trace import ReplayError, Trace, load_trace

__all__ = [
    "BeladyPolicy",
    "CostModel",
    "FutureIndex",
    "ReplayError",
    "ReplayResult",
    "TierSpec",
    "Trace",
    "estimate",
    "load_trace",
    "register",
    "replay",
    "run",
]
