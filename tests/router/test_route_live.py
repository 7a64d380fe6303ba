"""``kvstore route`` in front of three real ``kvstore engine --random-model`` replicas, driven
with the official ``openai`` client: affinity, the overload gate, failover, event resync,
tenants and the baseline policies (issue #11's list)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from kvstore.events import Subscriber

from route_helpers import BLOCK, Replica, RouterProcess, RouterThread
from waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[Replica]]:
    with ThreadPoolExecutor(3) as pool:
        reps = list(pool.map(lambda _: Replica(), range(3)))
    yield reps
    for r in reps:
        r.kill()


def start_router(replicas: list[Replica], *args: str) -> RouterProcess:
    router = RouterProcess(replicas, *args)
    router.wait_for(lambda v: all(r["healthy"] and r["mode"] == "events" for r in v.values()), 60,
                    "all replicas healthy with events")
    return router


def chat(client: Any, messages: list[dict[str, str]], max_tokens: int = 6) -> tuple[Any, dict[str, str]]:
    raw = client.chat.completions.with_raw_response.create(model="random", messages=messages,
                                                           max_tokens=max_tokens, temperature=0)
    return raw.parse(), dict(raw.headers)


def complete(client: Any, prompt: str, max_tokens: int = 4, **kw: Any) -> tuple[Any, dict[str, str]]:
    raw = client.completions.with_raw_response.create(model="random", prompt=prompt, max_tokens=max_tokens,
                                                      temperature=0, **kw)
    return raw.parse(), dict(raw.headers)


def test_multi_turn_conversations_stay_where_their_prefix_is(replicas: list[Replica]) -> None:
    router = start_router(replicas)
    try:
        client = router.client()
        first_replicas, last = [], None
        for conv in range(6):
            messages = [{"role": "system", "content": f"You are assistant number {conv}. " * 3}]
            previous: tuple[int, str] | None = None
            for turn in range(3):
                messages.append({"role": "user", "content": f"Question {turn} of conversation {conv}? " * 2})
                r, headers = chat(client, messages)
                replica, cached = headers["x-kvstore-replica"], r.usage.prompt_tokens_details.cached_tokens
                if previous is None:
                    first_replicas.append(replica)
                else:
                    prompt_tokens, where = previous
                    assert replica == where, f"conversation {conv} turn {turn} moved: {headers}"
                    assert cached >= prompt_tokens // BLOCK * BLOCK, (conv, turn, cached, prompt_tokens)
                    assert headers["x-kvstore-route-reason"] in ("cache_hit", "pending")
                    assert int(headers["x-kvstore-predicted-cached-tokens"]) <= cached
                previous = (r.usage.prompt_tokens, replica)
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
                last = (list(messages[:-1]), r.choices[0].message.content)
        assert len(set(first_replicas)) == 3, first_replicas  # distinct conversations spread out
        assert last is not None
        direct, _ = chat(replicas[0].client(), last[0])  # one engine's greedy output, no router
        assert direct.choices[0].message.content == last[1]
        stream = client.chat.completions.create(model="random", messages=last[0], max_tokens=6, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)  # passed through chunk by chunk, usage chunk last
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == last[1]
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
        metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in
                   httpx.get(f"{router.url}/metrics", timeout=5).text.splitlines() if line and line[0] != "#"}
        assert metrics['kvstore_router_decisions_total{reason="cache_hit"}'] >= 6
        predicted = metrics["kvstore_router_predicted_cached_tokens_total"]
        assert 0 < predicted <= metrics["kvstore_router_reported_cached_tokens_total"]
        assert metrics['kvstore_router_requests_total{endpoint="chat",status="200"}'] == 18 + 1  # + the stream
        assert "kvstore route" in httpx.get(f"{router.url}/router", timeout=5).text
        if CHROMIUM:  # the page, rendered by a real browser from the live router
            dom = render_page(f"{router.url}/router")
            rows = dict(re.findall(r'<tr data-replica="([^"]+)" data-mode="([a-z]+)"', dom))
            assert rows == {r.url: "events" for r in replicas}, dom[:3000]
            assert int(re.search(r'data-refreshes="(\d+)"', dom).group(1)) >= 2  # type: ignore[union-attr]
    finally:
        assert router.stop() == 0


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def render_page(url: str) -> str:
    with tempfile.TemporaryDirectory(prefix="kvr-chrome-") as profile:
        proc = subprocess.run(
            [CHROMIUM or "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=4000",
             "--dump-dom", url], capture_output=True, text=True, timeout=90)
    return proc.stdout


def test_the_overload_gate_spreads_a_hot_system_prompt(replicas: list[Replica]) -> None:
    router = start_router(replicas, "--gate-min-requests", "1")
    workers, per_worker = 12, 4
    samples: list[list[int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append([r["in_flight"] for r in router.replicas().values()])
            done.wait(0.02)  # a sample every 20 ms until the load is done

    def work(i: int) -> list[str]:
        client = router.client()
        out = []
        for j in range(per_worker):
            messages = [{"role": "system", "content": "A long shared system prompt for every user. " * 6},
                        {"role": "user", "content": f"user {i} asks question {j}"}]
            _, headers = chat(client, messages, max_tokens=24)
            out.append(headers["x-kvstore-replica"])
        return out

    try:
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with ThreadPoolExecutor(workers) as pool:
            placed = [url for urls in pool.map(work, range(workers)) for url in urls]
        done.set()
        sampler.join()
        # The mean in flight at full concurrency is workers / 3; the gate lets no replica past 1.5x it.
        mean = workers / len(replicas)
        busy = [s for s in samples if sum(s) >= workers // 2]
        assert busy, f"no sample with {workers // 2}+ requests in flight among {len(samples)}"
        assert all(max(s) <= 1.5 * mean for s in samples), [s for s in samples if max(s) > 1.5 * mean][:5]
        assert len(set(placed)) == 3 and min(placed.count(u) for u in set(placed)) >= workers * per_worker // 6
    finally:
        assert router.stop() == 0


def test_a_killed_replica_is_routed_around_and_taken_back(replicas: list[Replica]) -> None:
    router = start_router(replicas)
    victim = replicas[2]
    try:
        client = router.client()
        victim.kill()
        placed = [complete(client, f"after the kill, request number {i} " * 3)[1]["x-kvstore-replica"]
                  for i in range(9)]  # the router finds out by failing to connect: none fails
        assert victim.url not in placed
        view = router.wait_for(lambda v: not v[victim.url]["healthy"], 10, "the victim out")
        assert view[victim.url]["indexed_blocks"]["GPU"] == 0  # a dead replica holds nothing
        victim.start()
        router.wait_for(lambda v: v[victim.url]["healthy"] and v[victim.url]["mode"] == "events", 60,
                        "the victim back")
        placed = [complete(client, f"after the restart, request number {i} " * 3)[1]["x-kvstore-replica"]
                  for i in range(6)]
        assert victim.url in placed, placed
        assert router.replicas()[victim.url]["restarts"] == 1
    finally:
        assert router.stop() == 0


def real_blocks(replica: Replica) -> dict[str, int]:
    """The replica's block count per medium, from a fresh subscriber's snapshot of its own state."""
    endpoint = f"tcp://127.0.0.1:{replica.events_port}"
    with Subscriber(endpoint, replay_endpoint=f"tcp://127.0.0.1:{replica.events_port + 1}") as sub:

        def snapshot() -> int:
            if not sub.counters["snapshots"]:
                sub.poll(0.2)  # waits on the subscriber's socket
            return sub.counters["snapshots"]

        wait_until(snapshot, 10, "the replica's snapshot", poll_s=0)
        assert sub.counters["snapshots"] == 1
        return {medium: len(blocks) for medium, blocks in sub.sink.held().items()}


def test_a_restarted_replica_is_resynced_by_snapshot(replicas: list[Replica]) -> None:
    router = start_router(replicas)
    target = replicas[1]
    try:
        direct = target.client()
        for i in range(4):  # blocks on the target, seen by the router through its events
            direct.completions.create(model="random", prompt=f"resync prompt {i} " * 12, max_tokens=4)
        target.wait_idle()

        def counts(view: dict[str, Any]) -> dict[str, int]:
            return {m: n for m, n in view[target.url]["indexed_blocks"].items() if n and m != "ROUTED"}

        before = router.wait_for(lambda v: counts(v) == real_blocks(target), 10, "in step before the restart")
        assert counts(before).get("GPU", 0) > 0
        epoch = before[target.url]["events"]["epoch"]
        target.stop()
        target.start()  # a new epoch: the old entries are stale
        view = router.wait_for(lambda v: v[target.url]["healthy"] and v[target.url]["events"]["epoch"] != epoch,
                               60, "following the new epoch")
        for i in range(3):
            direct.completions.create(model="random", prompt=f"after restart {i} " * 12, max_tokens=4)
        target.wait_idle()
        view = router.wait_for(lambda v: counts(v) == real_blocks(target), 10, "in step after the restart")
        assert view[target.url]["events"]["snapshots"] >= 1
    finally:
        assert router.stop() == 0


def test_tenants_never_share_cache_affinity(replicas: list[Replica], tmp_path: Any) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[[tenant]]\nname = "acme"\ntokens = ["tok-acme"]\n\n'
                      '[[tenant]]\nname = "globex"\ntokens = ["tok-globex"]\n')
    router = start_router(replicas, "--tokens", str(tokens))
    try:
        acme, globex = router.client("tok-acme"), router.client("tok-globex")
        prompt = "An identical prompt that two tenants both send, word for word. " * 2
        _, h1 = complete(acme, prompt)
        a2, h2 = complete(acme, prompt)
        assert h2["x-kvstore-replica"] == h1["x-kvstore-replica"]  # the same-tenant control hits
        assert a2.usage.prompt_tokens_details.cached_tokens > 0
        g1, k1 = complete(globex, prompt)  # no affinity to acme's cache, and no cached tokens
        assert k1["x-kvstore-route-reason"] == "no_prefix" and g1.usage.prompt_tokens_details.cached_tokens == 0
        g2, k2 = complete(globex, prompt)
        assert k2["x-kvstore-replica"] == k1["x-kvstore-replica"] and g2.usage.prompt_tokens_details.cached_tokens > 0
        with pytest.raises(openai.AuthenticationError):
            complete(router.client("tok-nobody"), prompt)
        auth = {"authorization": "Bearer tok-acme"}
        bad = httpx.post(f"{router.url}/v1/completions", content=b"not json", headers=auth, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        bad = httpx.post(f"{router.url}/v1/completions", json={"prompt": prompt, "max_tokens": 0}, headers=auth,
                         timeout=10)  # the replica's own 400, passed through
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        assert httpx.get(f"{router.url}/v1/models", timeout=5).status_code == 401
    finally:
        assert router.stop() == 0


def test_round_robin_and_least_loaded_behave_as_named(replicas: list[Replica]) -> None:
    urls = [r.url for r in replicas]
    router = start_router(replicas, "--policy", "round_robin")
    try:
        placed = [complete(router.client(), "the same prompt every time " * 3)[1] for _ in range(6)]
        assert [h["x-kvstore-replica"] for h in placed] == urls + urls
        assert {h["x-kvstore-route-reason"] for h in placed} == {"round_robin"}
    finally:
        assert router.stop() == 0
    router = start_router(replicas, "--policy", "least_loaded")
    try:
        client = router.client()
        stream = client.completions.create(model="random", prompt="a long generation " * 4, max_tokens=400,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))  # the first chunk: it runs now
        busy = [u for u, r in router.replicas().items() if r["in_flight"]]
        assert len(busy) == 1
        placed = [complete(client, "the same prompt every time " * 3)[1]["x-kvstore-replica"] for _ in range(4)]
        assert busy[0] not in placed and len(set(placed)) == 2  # away from the busy one, cache ignored
        stream.close()
    finally:
        assert router.stop() == 0


def test_a_replica_without_events_is_routed_from_history(replicas: list[Replica]) -> None:
    silent = Replica(events=False)
    router = RouterProcess([silent, replicas[0]], "--pending-ttl", "0.5")
    try:
        # healthy comes first; "events" once the replica's subscriber has its first snapshot
        view = router.wait_for(lambda v: all(r["healthy"] for r in v.values())
                               and v[replicas[0].url]["mode"] == "events", 60, "both healthy, one on events")
        assert view[silent.url]["mode"] == "approximate" and view[replicas[0].url]["mode"] == "events"
        client, followed = router.client(), 0
        for conv in range(6):
            messages = [{"role": "user", "content": f"Conversation {conv} with a replica that sends no events. " * 2}]
            r, first = chat(client, messages)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "And a second question?"}]
            time.sleep(0.6)  # past the pending TTL (what is tested): only approximate mode remembers
            _, second = chat(client, messages)
            assert second["x-kvstore-replica"] == first["x-kvstore-replica"]
            if first["x-kvstore-replica"] == silent.url:
                assert second["x-kvstore-route-reason"] == "approximate"
                followed += 1
        assert followed >= 1
    finally:
        assert router.stop() == 0
        silent.kill()


def test_bad_token_ids_get_the_replicas_own_400(replicas: list[Replica]) -> None:
    router = RouterThread([r.url for r in replicas])  # in this process: no second process start
    try:
        router.wait_for(lambda v: all(r["healthy"] for r in v.values()), 30, "all replicas healthy")
        client = router.client()
        for prompt in ([-1, 5], [99999999999], [[2**32, 1]], [5, 2**31]):
            with pytest.raises(openai.BadRequestError) as refused:
                client.completions.create(model="random", prompt=prompt, max_tokens=2)
            assert refused.value.param == "prompt", refused.value.body  # the replica's OpenAI error, passed on
        assert complete(client, "still serving")[0].choices[0].text is not None
    finally:
        assert router.close() == 0
