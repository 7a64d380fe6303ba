"""``/metrics``: the server's Prometheus metrics, in a private registry (no global state).

Counted by the HTTP side as requests end: requests by endpoint and status, time to first
token, inter-token latency, prompt / cached (by tier) / computed / recomputed / generated
tokens. Read from the engine loop's last ``Load`` at scrape time: sequences running / waiting /
loading, device KV usage, blocks fetched from lower tiers and fetched blocks that fell back to
recompute; with ``--kv-events``, the publisher's ``kvstore_kv_events_*`` counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.events.metrics import event_families
from kvstore.services.engine_server.generation import TIERS, Generation
from kvstore.services.engine_server.loop import Load

PREFIX = "kvstore_engine"
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _LoadCollector(Collector):
    def __init__(self, load: Callable[[], Load], events: Any) -> None:
        self.load = load
        self.events = events  # the engine's EventPublisher, or None

    def collect(self) -> Iterator[Any]:
        if self.events is not None:
            yield from event_families(self.events.stats())
        load = self.load()
        seqs = GaugeMetricFamily(f"{PREFIX}_sequences", "Sequences by scheduler state", labels=["state"])
        for state in ("running", "waiting", "loading"):
            seqs.add_metric([state], getattr(load, state))
        yield seqs
        yield GaugeMetricFamily(f"{PREFIX}_device_kv_usage", "Fraction of device KV blocks held by requests",
                                value=load.kv_usage)
        yield GaugeMetricFamily(f"{PREFIX}_device_free_blocks", "Device KV blocks an allocation can get",
                                value=load.num_free_blocks)
        yield CounterMetricFamily(f"{PREFIX}_fetched_blocks", "Blocks fetched from lower tiers into the device",
                                  value=load.fetched_blocks)
        yield CounterMetricFamily(f"{PREFIX}_fetch_fallback_blocks",
                                  "Blocks a fetch failed to deliver, recomputed instead", value=load.failed_fetch_blocks)
        yield CounterMetricFamily(f"{PREFIX}_preemptions", "Sequences preempted (by recompute)",
                                  value=load.preemptions)


class ServerMetrics:
    """The counters and histograms the HTTP handlers update; ``render()`` is the exposition."""

    def __init__(self, load: Callable[[], Load], events: Any = None) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(f"{PREFIX}_requests", "HTTP API requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "From request arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Between successive tokens of a sample",
                             buckets=ITL_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_cached_prompt_tokens", "Prompt tokens served from a tier's cache",
                                     ["tier"], registry=r)
        self.computed_tokens = Counter(f"{PREFIX}_computed_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.recomputed_tokens = Counter(f"{PREFIX}_recomputed_tokens",
                                         "Tokens prefilled again after a preemption", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated", registry=r)
        for tier in TIERS:
            self.cached_tokens.labels(tier)
        r.register(_LoadCollector(load, events))

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def generation_done(self, gen: Generation) -> None:
        self.prompt_tokens.inc(gen.num_prompt_tokens)
        for tier in TIERS:
            self.cached_tokens.labels(tier).inc(gen.cached_tokens.get(tier, 0))
        self.computed_tokens.inc(gen.num_computed_tokens)
        self.recomputed_tokens.inc(gen.num_recomputed_tokens)
        self.generation_tokens.inc(gen.num_completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
