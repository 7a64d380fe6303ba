"""One request never hurts another, and every request's numbers are its own: ``kvstore engine``'s
app on a real uvicorn server in this process (so a test can reach its engine), with a device
pool small enough that samples preempt each other."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from serve_helpers import BLOCK, InProcessServer, stream_in_background


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    srv = InProcessServer()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def small() -> Iterator[InProcessServer]:
    srv = InProcessServer(kv_cache_bytes=16 * 2048)  # 16 blocks of the tests' model
    assert srv.llm.pool.num_blocks == 16
    yield srv
    srv.stop()


def counters(server: InProcessServer) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_preempted_samples_count_the_prompt_once(small: InProcessServer) -> None:
    # 8 samples of a 40-token prompt growing by 20 need 10 + 8 * 5 blocks of a 16-block pool:
    # they preempt each other; a readmission finds the request's own blocks again, or
    # recomputes those evicted meanwhile
    server = small
    before = counters(server)
    prompt = list(range(300, 340))
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "n": 8}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert server.llm.scheduler.num_preemptions > 0
    usage = r["usage"]
    assert usage["prompt_tokens"] == 40 and usage["completion_tokens"] == 8 * 20
    cached = usage["kvstore"]["cached_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == sum(cached.values()) == 0  # a new prompt
    assert usage["kvstore"]["computed_tokens"] == 40
    assert usage["kvstore"]["recomputed_tokens"] > 0  # the preempted samples' prompt and output again
    again = httpx.post(f"{server.url}/v1/completions", json={**body, "n": 1}, timeout=60).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == 40 // BLOCK * BLOCK  # found whole
    assert again["kvstore"]["computed_tokens"] == 40 - again["prompt_tokens_details"]["cached_tokens"]
    after = counters(server)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    cached_total = sum(delta(f'kvstore_engine_cached_prompt_tokens_total{{tier="{t}"}}')
                       for t in ("device", "host", "disk", "remote"))
    assert delta("kvstore_engine_prompt_tokens_total") == 80
    assert cached_total + delta("kvstore_engine_computed_prompt_tokens_total") == 80
    assert delta("kvstore_engine_recomputed_tokens_total") == usage["kvstore"]["recomputed_tokens"]


def test_a_failed_step_fails_its_requests_as_a_server_error(server: InProcessServer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that raises (here a ValueError, as a bad seed once did inside step()) is the
    server's fault: the requests it aborts get a 500 server_error, never a 400."""
    body = {"prompt": "a long stream", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    t, events = stream_in_background(server.url, body)

    def fail(*_args: Any) -> Any:
        raise ValueError("injected")

    monkeypatch.setattr(server.llm.runner, "run", fail)
    t.join(30)
    assert events[-1] == "data: [DONE]"
    assert '"type":"server_error"' in events[-2] and "the engine failed (ValueError)" in events[-2]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    monkeypatch.undo()
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3  # the server keeps serving
    assert counters(server)['kvstore_engine_requests_total{endpoint="completion",status="500"}'] == 2
    server.llm.check_integrity()
