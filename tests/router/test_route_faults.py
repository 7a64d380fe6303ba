"""``kvstore route`` (its own ``run``, on a thread) in front of fake replicas that fail on
demand: a stream cut mid-generation, a drain with streams live, bad token ids, malformed
tokenize replies, callers that go away, load reports, and every answer counted."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from starlette.responses import JSONResponse, Response

from kvstore.services.router.policy import RoutingPolicyConfig

from route_helpers import (
    FakeReplica,
    RouterThread,
    completion,
    metrics,
    sse_event,
    stream,
    until_disconnected,
)
from waiting import wait_until


@pytest.fixture
def fake() -> Iterator[FakeReplica]:
    replica = FakeReplica()
    yield replica
    replica.stop()


def start_router(fakes: list[FakeReplica], **config: Any) -> RouterThread:
    router = RouterThread([f.url for f in fakes], **config)
    router.wait_for(lambda v: all(r["healthy"] for r in v.values()), 10, "all replicas healthy")
    return router


def openai_client(router: RouterThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=10)


def requests_total(router: RouterThread, endpoint: str = "completion") -> dict[str, float]:
    prefix = f'kvstore_router_requests_total{{endpoint="{endpoint}",status="'
    return {k[len(prefix):-2]: v for k, v in metrics(router.url).items() if k.startswith(prefix)}


def test_a_stream_cut_mid_generation_ends_with_an_error_the_client_raises(fake: FakeReplica) -> None:
    # the replica dies after 5 events and half a sixth (kill -9: its kernel drops the connection)
    fake.answer = stream(5, cut_after=sse_event(5)[:20])
    router = start_router([fake])
    try:
        texts: list[str] = []
        with pytest.raises(openai.APIError, match="broke"):
            for chunk in openai_client(router).completions.create(model="random", prompt="hi", stream=True):
                texts.append(chunk.choices[0].text)
        assert texts == [f"t{i}" for i in range(5)]  # the whole events, never the half one
        with httpx.stream("POST", f"{router.url}/v1/completions", json={"prompt": "hi", "stream": True},
                          timeout=10) as response:
            events = response.read().split(b"\n\n")
        assert events[:5] == [sse_event(i)[:-2] for i in range(5)] and events[6:] == [b""]
        error = httpx.Response(200, content=events[5].removeprefix(b"data: ")).json()["error"]
        assert error["type"] == "server_error" and "RemoteProtocolError" in error["message"]
        assert b"[DONE]" not in b"".join(events)
        assert requests_total(router) == {"502": 2}
        assert router.replicas()[fake.url]["in_flight"] == 0
    finally:
        assert router.close() == 0


def test_a_cut_stream_that_is_not_sse_cuts_the_callers_connection(fake: FakeReplica) -> None:
    fake.answer = stream(3, cut_after=b"", media_type="application/x-ndjson")
    router = start_router([fake])
    try:
        with pytest.raises(httpx.RemoteProtocolError), \
                httpx.stream("POST", f"{router.url}/v1/completions", json={"prompt": "hi", "stream": True},
                             timeout=10) as response:
            response.read()
        assert requests_total(router) == {"502": 1}
    finally:
        assert router.close() == 0


def test_the_drain_waits_for_live_streams(fake: FakeReplica) -> None:
    fake.answer = stream(12, interval_s=0.25)  # 3 s, well past uvicorn's 1 s graceful timeout
    router = start_router([fake], drain_s=20.0)
    try:
        texts: list[str] = []
        for chunk in openai_client(router).completions.create(model="random", prompt="hi", stream=True):
            if not texts:
                router.drain()  # SIGTERM with the stream live
                wait_until(lambda: httpx.get(f"{router.url}/health", timeout=5).status_code == 503, 10,
                           "the router draining (its /health 503)")
                refused = httpx.post(f"{router.url}/v1/completions", json={"prompt": "later"}, timeout=5)
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
                assert requests_total(router) == {"503": 1}
            texts.append(chunk.choices[0].text)
        assert texts == [f"t{i}" for i in range(12)]  # ... to its end ([DONE], or the client raises)
    finally:
        assert router.close() == 0
    assert len(fake.bodies) == 1


def test_the_drain_gives_up_on_streams_after_drain_s(fake: FakeReplica) -> None:
    fake.answer = stream(1000, interval_s=0.05)
    router = start_router([fake], drain_s=0.5)
    with httpx.stream("POST", f"{router.url}/v1/completions", json={"prompt": "hi", "stream": True},
                      timeout=10) as response:
        lines = response.iter_lines()
        next(lines)
        started = time.monotonic()
        router.drain()
        with pytest.raises(httpx.HTTPError):
            for _ in lines:
                pass
    assert router.close() == 0
    assert time.monotonic() - started < 0.5 + 1.0 + 2.0  # drain_s, uvicorn's graceful timeout, slack


@pytest.mark.parametrize("prompt", [[-1, 5], [99999999999], [[2**32]], [True, 5], [1.5]])
def test_bad_token_ids_are_routed_without_a_prefix_and_answered_by_the_replica(
        fake: FakeReplica, prompt: Any) -> None:
    fake.answer = completion(status=400)  # what the engine says of ids outside its vocabulary
    router = start_router([fake])
    try:
        response = httpx.post(f"{router.url}/v1/completions", json={"prompt": prompt}, timeout=5)
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
        assert fake.bodies == [{"prompt": prompt}]
        assert response.headers["x-kvstore-predicted-cached-tokens"] == "0"
    finally:
        assert router.close() == 0


def test_a_prompt_no_tokenizer_can_encode_is_routed_without_a_prefix(fake: FakeReplica) -> None:
    fake.answer = completion(status=400)  # the engine: "prompt: a lone surrogate U+D800 ..."
    router = start_router([fake])
    try:
        response = httpx.post(f"{router.url}/v1/completions", content=b'{"prompt": "\\ud800"}',
                              headers={"content-type": "application/json"}, timeout=5)
        assert response.status_code == 400 and fake.bodies == [{"prompt": "\ud800"}]
    finally:
        assert router.close() == 0


@pytest.mark.parametrize("reply", [Response(b"<html>bad gateway</html>", media_type="text/html"),
                                   JSONResponse({"tokens": ["a", 1]}), JSONResponse({"tokens": [-3, 4]}),
                                   JSONResponse({"tokens": [2**32]}), JSONResponse([1, 2]),
                                   JSONResponse({"tokens": "abc"})])
def test_a_malformed_tokenize_reply_routes_without_a_prefix(reply: Response) -> None:
    fake = FakeReplica(tokenizer="hf")  # prompts and chats go through its /v1/kvstore/tokenize
    fake.tokenize_reply = reply
    router = start_router([fake])
    try:
        response = httpx.post(f"{router.url}/v1/completions", json={"prompt": "some text"}, timeout=5)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "ok"
        chat = httpx.post(f"{router.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                          timeout=5)
        assert chat.status_code == 200
    finally:
        assert router.close() == 0
        fake.stop()


def test_a_caller_that_goes_away_is_gone_for_the_replica_too(fake: FakeReplica) -> None:
    fake.answer = until_disconnected(fake)
    router = start_router([fake])
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{router.url}/v1/completions", json={"prompt": "abandoned"}, timeout=0.5)
        wait_until(lambda: fake.disconnects, 3, "the replica seeing its caller go")
        assert fake.disconnects == 1  # the replica saw its caller (the router) go: it aborts the request
        router.wait_for(lambda v: v[fake.url]["in_flight"] == 0, 3, "the request finished")
        assert requests_total(router) == {"499": 1}
    finally:
        assert router.close() == 0


def test_the_load_report_carries_the_free_blocks(fake: FakeReplica) -> None:
    fake.load["num_free_blocks"] = 123
    router = start_router([fake])
    try:
        router.wait_for(lambda v: v[fake.url]["num_free_blocks"] == 123, 3, "123 free blocks")
        for garbage in (-1, "12", 1.5, True, None):
            fake.load["num_free_blocks"] = garbage
            router.wait_for(lambda v: v[fake.url]["num_free_blocks"] is None, 3, f"{garbage!r} ignored")
            assert router.replicas()[fake.url]["healthy"]  # the rest of the report still counts
        del fake.load["num_free_blocks"]  # an engine that does not report it
        fake.load["queued_prefill_tokens"] = 7
        router.wait_for(lambda v: v[fake.url]["queued_prefill_tokens"] == 7, 3, "the report taken")
        assert router.replicas()[fake.url]["num_free_blocks"] is None
    finally:
        assert router.close() == 0


def test_every_answer_is_counted_with_its_final_status() -> None:
    fakes = [FakeReplica(), FakeReplica()]
    fakes[1].load_status = 503  # never healthy
    router = RouterThread([f.url for f in fakes], max_attempts=1, dead_after_s=30.0)
    try:
        router.wait_for(lambda v: v[fakes[0].url]["healthy"], 10, "the first replica healthy")
        post = lambda body: httpx.post(f"{router.url}/v1/completions", json=body, timeout=5)  # noqa: E731
        assert post({"prompt": "a"}).status_code == 200
        fakes[0].answer = completion(status=400)
        assert post({"prompt": "a"}).status_code == 400  # the replica's own answer
        fakes[0].answer = stream(2, cut_after=b"", media_type="application/json")  # a whole body, cut
        broken = post({"prompt": "a"})
        assert broken.status_code == 502 and broken.json()["error"]["type"] == "server_error"
        assert httpx.post(f"{router.url}/v1/completions", content=b"[", timeout=5).status_code == 400
        fakes[0].stop()  # still healthy in the router: the forward finds out
        unreached = post({"prompt": "a"})
        assert unreached.status_code == 503 and "1 attempts" in unreached.json()["error"]["message"]
        no_replica = post({"prompt": "a"})  # now taken out: none healthy
        assert no_replica.status_code == 503 and "no healthy replica" in no_replica.json()["error"]["message"]
        assert requests_total(router) == {"200": 1, "400": 2, "502": 1, "503": 2}
    finally:
        assert router.close() == 0
        fakes[1].stop()


def test_least_loaded_spreads_a_burst_between_two_load_reports() -> None:
    fakes = [FakeReplica(), FakeReplica()]
    fakes[0].load["running_decode_seqs"] = 1  # a little busier when the burst comes
    for f in fakes:
        f.answer = completion(hold_s=0.5)
    router = start_router(fakes, routing=RoutingPolicyConfig(policy="least_loaded"), health_interval_s=5.0)
    try:
        start = threading.Barrier(4)

        def send(i: int) -> str:
            start.wait()
            response = httpx.post(f"{router.url}/v1/completions", json={"prompt": f"request {i} " * 20}, timeout=10)
            return response.headers["x-kvstore-replica"]

        with ThreadPoolExecutor(4) as pool:
            placed = list(pool.map(send, range(4)))
        assert sorted(placed.count(f.url) for f in fakes) == [2, 2], placed
    finally:
        assert router.close() == 0
        for f in fakes:
            f.stop()
