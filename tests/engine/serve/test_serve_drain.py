"""SIGTERM drains ``kvstore engine``: requests in flight finish, new ones get 503 meanwhile,
the engine closes and the process exits 0."""

from __future__ import annotations

import threading
import time

import httpx

from serve_helpers import EngineServer


def test_sigterm_drains_in_flight_requests() -> None:
    server = EngineServer("--drain-s", "60")
    try:
        events: list[str] = []
        body = {"prompt": "drain me", "max_tokens": 450, "temperature": 0, "ignore_eos": True, "stream": True}
        first = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(30)
        server.proc.send_signal(15)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the signal is handled between two awaits: poll for 503
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "late"}, timeout=10)
            if r.status_code == 503:
                break
            time.sleep(0.02)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text
        assert httpx.get(f"{server.url}/health").status_code == 503
        t.join(60)
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2], events[-3:]
        assert server.proc.wait(30) == 0
        assert "kvstore engine: stopped" in server.output
    finally:
        server.kill()
