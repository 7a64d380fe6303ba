"""``kvstore engine --kv-events``: /v1/kvstore/info names the bound publisher, and a router that
builds keys from info's namespace finds a served prompt's blocks on medium GPU in the events
(a real ZeroMQ subscriber on the engine's real sockets); /metrics carries the publisher's counters."""

from __future__ import annotations

import httpx

from kvstore.events import GPU, Subscriber
from kvstore.keys import BlockHasher, Namespace
from kvstore.layout import DTYPES_BY_NAME, KVLayout

from serve_helpers import BLOCK, EngineServer
from waiting import wait_until


def test_info_names_the_publisher_and_events_match_the_namespace() -> None:
    server = EngineServer("--kv-events", "tcp://127.0.0.1:*", "--kv-events-replay", "tcp://127.0.0.1:*")
    sub = None
    try:
        info = httpx.get(f"{server.url}/v1/kvstore/info").json()
        events = info["kv_events"]
        assert events["endpoint"].startswith("tcp://127.0.0.1:") and not events["endpoint"].endswith("*")
        assert events["replay_endpoint"].startswith("tcp://127.0.0.1:") and events["topic"] == ""
        sub = Subscriber(events["endpoint"], replay_endpoint=events["replay_endpoint"], topic=events["topic"]).start()
        ns = info["namespace"]
        layout = KVLayout(ns["num_layers"], ns["num_kv_heads"], ns["head_dim"], ns["block_size"],
                          DTYPES_BY_NAME[ns["dtype"]], ns["tp_rank"], ns["tp_size"])
        prompt = [40 + i for i in range(8 * BLOCK + 1)]
        keys = BlockHasher(Namespace(ns["model_id"], layout, ns["hash_algo"])).block_keys(prompt, "")
        assert len(keys) == 8
        r = server.client().completions.create(model="random", prompt=prompt, max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
        wait_until(lambda: sub.sink.prefix_on(GPU, keys) >= 8, 10, "the prompt's 8 blocks seen on GPU")
        assert sub.sink.prefix_on(GPU, keys) == 8  # the router's keys are the engine's
        metrics = httpx.get(f"{server.url}/metrics").text
        assert "kvstore_kv_events_events_total" in metrics and "kvstore_kv_events_dropped_events_total 0.0" in metrics
    finally:
        if sub is not None:
            sub.close()
        server.kill()
