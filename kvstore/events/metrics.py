"""Prometheus families for a publisher's counters (the daemon's and the engine server's /metrics)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

COUNTERS = {"batches": "KV event batches published (heartbeats included)",
            "events": "KV events published", "heartbeats": "Empty batches sent while idle",
            "dropped_events": "KV events dropped because the publisher queue was full",
            "replays": "Replay requests answered", "snapshots": "Snapshot requests answered",
            "send_errors": "Batches the PUB socket refused"}


def event_families(stats: dict[str, Any]) -> Iterator[Any]:
    """``kvstore_kv_events_*`` from ``EventPublisher.stats()``."""
    for name, doc in COUNTERS.items():
        yield CounterMetricFamily(f"kvstore_kv_events_{name}", doc, value=stats[name])
    yield GaugeMetricFamily("kvstore_kv_events_queued", "KV events waiting for the publisher thread",
                            value=stats["queued"])
