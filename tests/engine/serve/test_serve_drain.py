"""SIGTERM drains ``kvstore engine``: requests in flight finish, new ones get 503 meanwhile,
the engine closes and the process exits 0."""

from __future__ import annotations

import httpx

from serve_helpers import EngineServer, stream_in_background
from waiting import wait_until


def test_sigterm_drains_in_flight_requests() -> None:
    server = EngineServer("--drain-s", "60")
    try:
        # 8 samples of 450 tokens: seconds of work, so the drain is still on when the checks run
        body = {"prompt": "drain me", "max_tokens": 450, "temperature": 0, "ignore_eos": True, "stream": True,
                "n": 8}
        t, events = stream_in_background(server.url, body)
        server.proc.send_signal(15)

        def draining() -> httpx.Response | None:
            health = httpx.get(f"{server.url}/health", timeout=10)
            return health if health.status_code == 503 else None

        r = wait_until(draining, 10, "/health answering 503", poll_s=0.01)  # handled between two awaits
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "late"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text
        t.join(60)
        assert events[-1] == "data: [DONE]", events[-3:]
        assert sum('"finish_reason":"length"' in e for e in events) == 8, events[-10:]
        assert server.proc.wait(30) == 0
        assert "kvstore engine: stopped" in server.output
    finally:
        server.kill()
