"""Real processes for the router tests: ``kvstore engine`` replicas (the server tests' helper,
with KV events on fixed ports so that a restarted replica keeps its URL and endpoints) and
``kvstore route`` in front of them."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvstore.ports import free_port_pair

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "engine" / "serve"))

from serve_helpers import BLOCK, ENGINE_ARGS, MAX_MODEL_LEN, CliServer, EngineServer  # noqa: E402

ROUTER_TOKEN = "router-secret-5678"
__all__ = ["BLOCK", "ENGINE_ARGS", "MAX_MODEL_LEN", "ROUTER_TOKEN", "EngineServer", "Replica", "RouterProcess",
           "free_ports"]




def free_ports(count: int) -> list[int]:
    """``count`` TCP ports, each followed by a free one (a KV-events replay port), none handed
    out before in this process, below Linux's ephemeral range (kvstore.ports)."""
    return [free_port_pair() for _ in range(count)]


class Replica:
    """One ``kvstore engine`` replica on fixed HTTP and KV-event ports, restartable in place."""

    def __init__(self, *extra: str, events: bool = True) -> None:
        self.http_port, self.events_port = free_ports(2)
        self.extra = extra
        self.events = events
        self.server: EngineServer | None = None
        self.start()

    def start(self) -> None:
        events = ["--kv-events", f"tcp://127.0.0.1:{self.events_port}"] if self.events else []
        self.server = EngineServer("--port", str(self.http_port), "--router-token", ROUTER_TOKEN, *events,
                                   *self.extra)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def client(self) -> Any:
        assert self.server is not None
        return self.server.client(ROUTER_TOKEN)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until nothing runs, waits or holds a device block (its load, asked with the token)."""
        deadline = time.monotonic() + timeout
        while True:
            load = httpx.get(f"{self.url}/v1/kvstore/load", timeout=5,
                             headers={"authorization": f"Bearer {ROUTER_TOKEN}"}).json()
            if not (load["running"] or load["waiting"] or load["loading"]) and load["kv_usage"] == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.url} not idle after {timeout} s: {load}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.server is not None:
            self.server.kill()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


class RouterProcess(CliServer):
    """``python -m kvstore.cli route ...`` on a free port; ``url`` once it printed ready."""

    def __init__(self, replicas: list[Replica], *args: str) -> None:
        super().__init__(["route", *[a for r in replicas for a in ("--replica", r.url)], "--port", "0",
                          "--router-token", ROUTER_TOKEN, *args], timeout=90)

    def client(self, api_key: str = "unused") -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def replicas(self) -> dict[str, Any]:
        """``GET /v1/router/replicas``, by URL."""
        view = httpx.get(f"{self.url}/v1/router/replicas", timeout=5).json()
        return {r["url"]: r for r in view["replicas"]}

    def wait_for(self, predicate: Any, timeout: float = 30.0, what: str = "") -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            view = self.replicas()
            if predicate(view):
                return view
            if time.monotonic() > deadline:
                raise AssertionError(f"router: not {what} after {timeout} s: {view}\n{self.output}")
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)
