"""One replica as the router sees it: its recipe, its event stream, its health and load.

``ReplicaLink`` learns a replica from ``GET /v1/kvstore/info`` (model, key namespace with its
KV groups, block size, tokenizer kind, event endpoints), follows its KV events with the events library's
``Subscriber`` (sequence numbers, replay of gaps, snapshot on start and on epoch change) into
the Router's index, and polls ``GET /v1/kvstore/load`` every ``health_interval_s``: the load
feeds the Router's costs, and a replica that has not answered for ``dead_after_s`` is taken
out (its index entries cleared). When it answers again, it is learned afresh (a restart has a
new ``engine_id``) with a new subscriber, whose snapshot rebuilds its entries, and taken back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvstore.errors import ConfigError
from kvstore.events import CallbackSink, Subscriber
from kvstore.keys import Namespace
from kvstore.layout import DTYPES_BY_NAME, KVGroup, KVLayout
from kvstore.services.router.policy import LoadReport, Router

log = logging.getLogger("kvstore.services.router")


@dataclass(frozen=True)
class ReplicaInfo:
    """What ``/v1/kvstore/info`` says (docs/serving.md)."""

    model: str
    engine_id: str
    namespace: Namespace
    tokenizer_kind: str
    events_endpoint: str | None
    replay_endpoint: str | None
    topic: str
    max_model_len: int

    @property
    def block_size(self) -> int:
        return self.namespace.layout.block_size


def parse_info(body: Any) -> ReplicaInfo:
    """A replica's info body -> ReplicaInfo; ValueError naming what is missing or wrong."""
    try:
        ns = body["namespace"]
        # a replica from before KV groups lists none: one full-attention group, as its keys say
        groups = tuple(KVGroup(g["kind"], tuple(g["layers"]), g.get("window")) for g in ns.get("groups") or ())
        layout = KVLayout(num_layers=ns["num_layers"], num_kv_heads=ns["num_kv_heads"], head_dim=ns["head_dim"],
                          block_size=ns["block_size"], dtype=DTYPES_BY_NAME[ns["dtype"]], tp_rank=ns["tp_rank"],
                          tp_size=ns["tp_size"], groups=groups)
        events = body.get("kv_events") or {}
        return ReplicaInfo(str(body["model"]), str(body["engine_id"]), Namespace(ns["model_id"], layout, ns["hash_algo"]),
                           str(body["tokenizer"]["kind"]), events.get("endpoint"), events.get("replay_endpoint"),
                           str(events.get("topic") or ""), int(body["max_model_len"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a malformed /v1/kvstore/info: {type(exc).__name__}: {exc}") from None


def events_sink(router: Router, replica: str) -> CallbackSink:
    """The events library's CallbackSink, folding one replica's events into the Router's index.

    Hashes that are not kvstore keys (a plain vLLM publisher's 64-bit ints) cannot match a
    prompt the router hashed, so they are skipped; an event of an unknown medium is logged.
    """

    def keys(hashes: list[Any]) -> list[bytes]:
        return [h for h in hashes if isinstance(h, bytes)]

    def apply(update: Any, hashes: list[Any], medium: str) -> None:
        found = keys(hashes)
        if found:
            try:
                update(replica, found, medium)
            except (KeyError, ValueError) as exc:
                log.warning("replica %s: event ignored: %s", replica, exc)

    return CallbackSink(lambda hashes, medium: apply(router.stored, hashes, medium),
                        lambda hashes, medium: apply(router.removed, hashes, medium),
                        lambda: router.cleared(replica))


class ReplicaLink:
    """The router's link to one replica (see module). Health polling runs on the event loop;
    the subscriber on its own thread."""

    def __init__(self, url: str, router_headers: dict[str, str], health_interval_s: float,
                 dead_after_s: float) -> None:
        self.url = url
        self.headers = router_headers
        self.health_interval_s, self.dead_after_s = health_interval_s, dead_after_s
        self.info: ReplicaInfo | None = None
        self.router: Router | None = None
        self.healthy = False
        self.problem: str | None = "not reached yet"
        self.load = LoadReport()
        self.last_ok = 0.0
        self.restarts = 0
        self.subscriber: Subscriber | None = None

    async def learn(self, client: httpx.AsyncClient) -> ReplicaInfo:
        """Fetch and parse the replica's info (raises httpx errors or ValueError)."""
        response = await client.get(f"{self.url}/v1/kvstore/info", headers=self.headers,
                                    timeout=self.health_interval_s * 4)
        response.raise_for_status()
        return parse_info(response.json())

    async def check(self, client: httpx.AsyncClient, router: Router, recipe: ReplicaInfo) -> None:
        """One health round: poll the load; take the replica out or back in as needed."""
        now = time.monotonic()
        try:
            response = await client.get(f"{self.url}/v1/kvstore/load", headers=self.headers,
                                        timeout=self.health_interval_s * 2)
            response.raise_for_status()
            body = response.json()
            # an engine that does not report its free blocks (or not as a count): no eviction cost
            free = body.get("num_free_blocks") if isinstance(body, dict) else None
            load = LoadReport(int(body["queued_prefill_tokens"]), int(body["running_decode_seqs"]),
                              int(body["running"]), int(body["waiting"]), float(body["kv_usage"]),
                              free if type(free) is int and free >= 0 else None)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            if self.healthy and now - self.last_ok > self.dead_after_s:
                self.take_out(router, f"no answer for {now - self.last_ok:.1f} s ({type(exc).__name__})")
            elif not self.healthy:
                self.problem = f"unreachable ({type(exc).__name__})"
            return
        self.last_ok = now
        self.load = load
        if not self.healthy:
            await self._take_back(client, router, recipe)
        if self.healthy:
            router.update_load(self.url, load)
            approximate = self.subscriber is None or self.subscriber.approximate
            router.set_approximate(self.url, approximate)

    async def _take_back(self, client: httpx.AsyncClient, router: Router, recipe: ReplicaInfo) -> None:
        try:
            info = await self.learn(client)
        except (httpx.HTTPError, ValueError) as exc:
            self.problem = f"info: {exc}"
            return
        if info.namespace != recipe.namespace or info.tokenizer_kind != recipe.tokenizer_kind:
            self.problem = (f"serves another model or key recipe ({info.namespace.model_id}, "
                            f"{info.namespace.layout.fingerprint()}) than the first replica")
            return
        if self.info is not None and info.engine_id != self.info.engine_id:
            self.restarts += 1
        self.info, self.router = info, router
        self._start_events(router)
        router.set_healthy(self.url, True)
        self.healthy, self.problem = True, None
        log.warning("replica %s: in service", self.url)

    def take_out(self, router: Router, why: str) -> None:
        """The replica is gone: nothing it held counts (index and guesses cleared)."""
        router.set_healthy(self.url, False)
        self.healthy, self.problem = False, why
        self._stop_events()
        log.warning("replica %s: out of service: %s", self.url, why)

    def _start_events(self, router: Router) -> None:
        self._stop_events()
        router.cleared(self.url)  # the new subscriber's snapshot is the truth
        assert self.info is not None
        if not self.info.events_endpoint:
            return  # no events: the router routes it from its own history (approximate)
        try:
            self.subscriber = Subscriber(self.info.events_endpoint, events_sink(router, self.url),
                                         replay_endpoint=self.info.replay_endpoint or "", topic=self.info.topic,
                                         heartbeat_timeout_s=max(3.0, 4 * self.health_interval_s)).start()
        except ConfigError as exc:  # an endpoint ZeroMQ cannot use: routed as a replica without events
            log.warning("replica %s: no KV events: %s", self.url, exc)

    def _stop_events(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
            self.subscriber = None

    def status(self, router: Router) -> dict[str, Any]:
        """This replica's row of ``GET /v1/router/replicas``."""
        state = router.replicas.get(self.url)
        events = self.subscriber.stats() if self.subscriber is not None else {}
        mode = "down" if not self.healthy else (
            "approximate" if self.subscriber is None or self.subscriber.approximate else "events")
        return {
            "url": self.url, "healthy": self.healthy, "mode": mode, "problem": self.problem,
            "engine_id": self.info.engine_id if self.info else None, "restarts": self.restarts,
            "in_flight": state.in_flight if state else 0,
            "queued_prefill_tokens": max(self.load.queued_prefill_tokens, state.routed_prefill_tokens if state else 0),
            "running_decode_seqs": self.load.running_decode_seqs, "kv_usage": self.load.kv_usage,
            "num_free_blocks": self.load.num_free_blocks,
            "indexed_blocks": router.indexed_blocks(self.url) if state else {},
            "decisions": state.decisions if state else 0,
            "events": {"endpoint": self.info.events_endpoint if self.info else None,
                       "last_seq": events.get("last_seq"), "epoch": events.get("epoch"),
                       "gaps": events.get("gaps", 0), "replays": events.get("replays", 0),
                       "snapshots": events.get("snapshots", 0), "batches": events.get("batches", 0)},
        }

    def close(self) -> None:
        self._stop_events()
