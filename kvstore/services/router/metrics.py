"""``/metrics`` of ``kvstore route``: Prometheus text from a private registry.

Counted as requests end: requests by endpoint and status, retries, routing decision time,
and predicted vs replica-reported cached tokens (the router's prediction is the chosen
replica's leading cached run; the replica reports ``usage.prompt_tokens_details.cached_tokens``).
Read from the Router at scrape time: decisions by reason, per replica health, in-flight
requests and indexed blocks per tier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.services.router.policy import Decision, Router

PREFIX = "kvstore_router"
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
ERROR_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384)


class _RouterCollector(Collector):
    def __init__(self, router: Callable[[], Router | None], healthy: Callable[[], dict[str, bool]]) -> None:
        self.router, self.healthy = router, healthy

    def collect(self) -> Iterator[Any]:
        router = self.router()
        if router is None:
            return
        reasons = CounterMetricFamily(f"{PREFIX}_decisions", "Routing decisions by reason", labels=["reason"])
        for reason, n in sorted(router.reasons.items()):
            reasons.add_metric([reason], n)
        yield reasons
        healthy = GaugeMetricFamily(f"{PREFIX}_replica_healthy", "1 while the replica is in service",
                                    labels=["replica"])
        in_flight = GaugeMetricFamily(f"{PREFIX}_replica_in_flight", "Requests routed to the replica, not finished",
                                      labels=["replica"])
        blocks = GaugeMetricFamily(f"{PREFIX}_replica_indexed_blocks", "Blocks indexed per replica and tier",
                                   labels=["replica", "tier"])
        for url, ok in self.healthy().items():
            healthy.add_metric([url], 1.0 if ok else 0.0)
            state = router.replicas.get(url)
            in_flight.add_metric([url], state.in_flight if state else 0)
            if state is not None:
                for tier, n in router.indexed_blocks(url).items():
                    blocks.add_metric([url, tier], n)
        yield from (healthy, in_flight, blocks)


class RouteMetrics:
    def __init__(self, router: Callable[[], Router | None], healthy: Callable[[], dict[str, bool]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_requests", "API requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.retries = Counter(f"{PREFIX}_retries", "Forwards retried on another replica (never started)",
                               ["endpoint"], registry=self.registry)
        self.latency = Histogram(f"{PREFIX}_routing_seconds", "Time to decide (hashing included)",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.predicted = Counter(f"{PREFIX}_predicted_cached_tokens", "Cached prompt tokens the router predicted",
                                 registry=self.registry)
        self.reported = Counter(f"{PREFIX}_reported_cached_tokens", "Cached prompt tokens the replicas reported",
                                registry=self.registry)
        self.error = Histogram(f"{PREFIX}_cached_tokens_prediction_error", "|predicted - reported| cached tokens",
                               buckets=ERROR_BUCKETS, registry=self.registry)
        self.registry.register(_RouterCollector(router, healthy))

    def decided(self, decision: Decision) -> None:
        self.latency.observe(decision.seconds)

    def retried(self, endpoint: str) -> None:
        self.retries.labels(endpoint).inc()

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def observed_cached(self, decision: Decision, reported: int | None) -> None:
        if reported is None:
            return
        self.predicted.inc(decision.predicted_cached_tokens)
        self.reported.inc(reported)
        self.error.observe(abs(decision.predicted_cached_tokens - reported))

    def render(self) -> bytes:
        return generate_latest(self.registry)
