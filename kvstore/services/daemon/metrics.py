"""Prometheus exposition: per-tier gauges and counters (label ``tier``, ``namespace``), read
from the stores at scrape time, plus the daemon's request and error counters, and the
per-tenant series for the tenants the caller may see (rest.py decides which).

Per-tenant usage (``kvstore_tenant_*{tenant, tier}``: blocks and bytes held, hits, misses,
evictions caused and suffered, puts refused, quota limits) has bounded label cardinality: the
``MAX_TENANT_SERIES`` tenants holding the most bytes get series of their own, the rest are
summed under ``tenant="(other)"`` (a sum over a changing set of tenants: its counters can step
down when one of them moves into the top). Series: at most (MAX_TENANT_SERIES + 1) x tiers per
family."""

from __future__ import annotations

from collections.abc import Container, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.events.metrics import event_families
from kvstore.policy.tenant_counters import OTHER_TENANTS
from kvstore.services.daemon.registry import Registry

MAX_TENANT_SERIES = 20  # tenants with series of their own; the rest are summed as "(other)"
TENANT_GAUGES = {"blocks": "Blocks the tenant holds in the tier", "bytes": "Bytes the tenant's blocks occupy in the tier",
                 "soft_blocks": "The tenant's soft quota in the tier, in blocks (absent: none)",
                 "hard_blocks": "The tenant's hard quota in the tier, in blocks (absent: none)"}
TENANT_COUNTERS = {"hits": "The tenant's blocks found in the tier by lookups and reads",
                   "misses": "The tenant's blocks asked of the tier and not found",
                   "evictions_suffered": "The tenant's blocks evicted from the tier",
                   "evictions_caused": "Evictions from the tier whose room the tenant's blocks took",
                   "refused": "Blocks of the tenant's puts refused at its hard quota"}

GAUGES = {"capacity_bytes": "Capacity of the tier in bytes", "used_bytes": "Bytes the tier's blocks occupy",
          "num_blocks": "Blocks the tier holds"}
COUNTERS = {"hits": "Blocks found in the tier by lookups and reads",
            "misses": "Blocks asked of the tier and not found", "evictions": "Blocks evicted from the tier",
            "bytes_read": "Bytes read from the tier", "bytes_written": "Bytes written to the tier",
            "errors": "I/O and checksum errors of the tier",
            "refused": "Blocks in an encoding this reader refuses (another codec version): misses"}


class StoreCollector(Collector):
    def __init__(self, registry: Registry, daemon: Any = None, tenants: Container[str] | None = None) -> None:
        self.registry = registry
        self.daemon = daemon
        self.tenants = tenants

    def collect(self) -> Iterator[Any]:
        rows = [(s.id, tier, stats) for s in self.registry.namespaces() for tier, stats in s.store.stats().items()]
        for name, doc in GAUGES.items():
            g = GaugeMetricFamily(f"kvstore_tier_{name}", doc, labels=["tier", "namespace"])
            for ns, tier, stats in rows:
                g.add_metric([tier, ns], stats[name])
            yield g
        for name, doc in COUNTERS.items():
            c = CounterMetricFamily(f"kvstore_tier_{name}", doc, labels=["tier", "namespace"])
            for ns, tier, stats in rows:
                c.add_metric([tier, ns], stats[name])
            yield c
        yield from remote_families(rows, self.registry.remote_nodes())
        tenants = CounterMetricFamily("kvstore_tenant_requests", "Block protocol requests per tenant",
                                      labels=["tenant"])
        for tenant, counters in self.registry.tenant_counters().items():
            if self.tenants is None or tenant in self.tenants:
                tenants.add_metric([tenant], counters["requests"])
        yield tenants
        yield from tenant_families(self.registry.tenant_usage(), self.tenants)
        if self.daemon is not None:
            ops = CounterMetricFamily("kvstore_daemon_requests", "Block protocol requests by op", labels=["op"])
            for op, n in sorted(self.daemon.ops.requests.items()):
                ops.add_metric([op], n)
            yield ops
            errors = CounterMetricFamily("kvstore_daemon_errors", "Error frames sent, by code", labels=["code"])
            for code, n in sorted(self.daemon.ops.errors.items()):
                errors.add_metric([code], n)
            yield errors
            yield GaugeMetricFamily("kvstore_daemon_connections", "Open block protocol connections",
                                    value=self.daemon.num_connections)
            yield GaugeMetricFamily("kvstore_daemon_leases", "Live shared-memory leases", value=len(self.daemon.leases))
            if getattr(self.daemon, "kv_events", None) is not None:
                yield from event_families(self.daemon.kv_events.stats())


def tenant_families(usage: dict[str, dict[str, Any]], visible: Container[str] | None) -> Iterator[Any]:
    """``kvstore_tenant_*{tenant, tier}`` for the ``visible`` tenants (None: all): the top
    ``MAX_TENANT_SERIES`` by bytes held, the rest summed as ``(other)``. The families are
    declared even when no tenant's series may be shown."""
    rows = {t: u for t, u in usage.items() if visible is None or t in visible}
    ranked = sorted(rows, key=lambda t: (-rows[t]["bytes"], t))
    shown: dict[str, dict[str, dict[str, Any]]] = {t: rows[t]["tiers"] for t in ranked[:MAX_TENANT_SERIES]}
    if len(ranked) > MAX_TENANT_SERIES:
        other: dict[str, dict[str, Any]] = {}
        for tenant in ranked[MAX_TENANT_SERIES:]:
            for tier, row in rows[tenant]["tiers"].items():
                acc = other.setdefault(tier, {})
                for name, value in row.items():
                    if value is not None:
                        acc[name] = acc.get(name, 0) + value
        shown[OTHER_TENANTS] = other
    for families, kind in ((TENANT_GAUGES, GaugeMetricFamily), (TENANT_COUNTERS, CounterMetricFamily)):
        for name, doc in families.items():
            family = kind(f"kvstore_tenant_{name}", doc, labels=["tenant", "tier"])
            for tenant, tiers in shown.items():
                for tier, row in tiers.items():
                    if row.get(name) is not None:
                        family.add_metric([tenant, tier], row[name])
            yield family


REMOTE_COUNTERS = {"dropped": "Blocks a write-behind gave up on (queue full or node failed)",
                   "round_trips": "Requests to the remote a caller waited for (nodes asked in parallel count once)",
                   "hint_hits": "Blocks a lookup or read answered from a fresh hint, without a request",
                   "hint_misses": "Blocks a lookup had to ask the remote about",
                   "kept_used": "Values a read took from the lookup before it instead of asking again",
                   "replica_reads": "Node reads a replica answered (READONLY) for its failed primary"}
NODE_GAUGES = {"used_memory": "Bytes the remote node uses (Redis INFO used_memory)",
               "maxmemory": "The remote node's maxmemory limit in bytes (0: none)",
               "keys": "Keys in the remote node's database (DBSIZE)"}


def remote_families(rows: list[tuple[str, str, dict[str, int]]], nodes: list[dict[str, Any]]) -> Iterator[Any]:
    """The remote tier's own series: dropped writes, round trips and hint use per namespace,
    and per node (label ``node``, HOST:PORT) memory, limit, keys, evictions and whether it
    answered."""
    shared = [(ns, tier, stats) for ns, tier, stats in rows if "dropped" in stats]
    if not shared and not nodes:
        return
    for name, doc in REMOTE_COUNTERS.items():
        family = CounterMetricFamily(f"kvstore_tier_{name}", doc, labels=["tier", "namespace"])
        for ns, tier, stats in shared:
            family.add_metric([tier, ns], stats.get(name, 0))
        yield family
    for name, doc in NODE_GAUGES.items():
        g = GaugeMetricFamily(f"kvstore_remote_node_{name}", doc, labels=["node"])
        for node in nodes:
            g.add_metric([node["address"]], node[name])
        yield g
    evicted = CounterMetricFamily("kvstore_remote_node_evicted_keys", "Keys the remote node evicted "
                                  "(Redis INFO evicted_keys)", labels=["node"])
    up = GaugeMetricFamily("kvstore_remote_node_up", "1 when the remote node answered INFO", labels=["node"])
    for node in nodes:
        evicted.add_metric([node["address"]], node["evicted_keys"])
        up.add_metric([node["address"]], 1 if node["up"] else 0)
    yield evicted
    yield up


def render(registry: Registry, daemon: Any = None, tenants: Container[str] | None = None) -> bytes:
    """The text exposition format, from a private registry (no global state).

    Args:
        tenants: the tenants whose series to include (None: every tenant; empty: none).
    """
    prom = CollectorRegistry(auto_describe=False)
    prom.register(StoreCollector(registry, daemon, tenants))
    return generate_latest(prom)
