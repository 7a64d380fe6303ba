"""Pure policy: which block to evict (eviction), which to let into a tier (admission, with the
frequency sketch and the seen-once list), and how tenants share a tier (tenant_policy, quotas,
tenant_counters).

Decisions over keys and counts, nothing else: no torch, no I/O, no store. The store's levels
and ``kvstore replay`` use the same objects, so a trace replayed offline meets the policies the
store runs.
"""
