"""SIGTERM drains ``kvstore engine``: requests in flight finish, new ones get 503 meanwhile,
the engine closes and the process exits 0."""

from __future__ import annotations

import time

import httpx

from serve_helpers import EngineServer, stream_in_background


def test_sigterm_drains_in_flight_requests() -> None:
    server = EngineServer("--drain-s", "60")
    try:
        # 8 samples of 450 tokens: seconds of work, so the drain is still on when the checks run
        body = {"prompt": "drain me", "max_tokens": 450, "temperature": 0, "ignore_eos": True, "stream": True,
                "n": 8}
        t, events = stream_in_background(server.url, body)
        server.proc.send_signal(15)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the signal is handled between two awaits: poll for 503
            r = httpx.get(f"{server.url}/health", timeout=10)
            if r.status_code == 503:
                break
            time.sleep(0.01)
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
