"""Real ``kvstore engine`` processes for the server tests: started on a free port, ready when
/health answers, stopped by SIGTERM (or killed). ``InProcessServer``: the same app on a real
uvicorn server in a thread of the test, for tests that need to reach the engine it serves."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from waiting import wait_serving, wait_until

ROOT = Path(__file__).resolve().parents[3]
# small enough that a start and a few hundred decode steps take seconds on a loaded CPU
TINY = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
            vocab_size=512)
BLOCK = 4
MAX_MODEL_LEN = 512
ENGINE_ARGS = ["--random-model", "--random-config", json.dumps(TINY), "--block-size", str(BLOCK),
               "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache", "4MiB", "--seed", "3"]
EMBEDDED_ARGS = ["--host-mem", "8MiB"]  # with --store-url the daemon's tiers serve: no store flags then


def stream_in_background(url: str, body: dict[str, Any]) -> tuple[threading.Thread, list[str]]:
    """POST the streamed completion ``body`` to ``url`` on a thread; returns once its first
    line came: the thread (join it) and the non-empty lines read, filled as they come."""
    lines: list[str] = []
    first = threading.Event()

    def read() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first.set()

    thread = threading.Thread(target=read)
    thread.start()
    assert first.wait(30), "the stream sent nothing in 30 s"
    return thread, lines


class CliServer:
    """``python -m kvstore.cli ARGS`` in a subprocess, up once it printed a line ending in
    "ready" (``url`` is the http://host:port that line names); its output keeps being read."""

    def __init__(self, args: list[str], timeout: float, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "kvstore.cli", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        self.deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < self.deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"kvstore {args[0]} exited ({self.proc.wait()}): {''.join(self.lines)}")
            self.lines.append(line)
            if line.rstrip().endswith("ready"):
                break
        match = re.search(r"on (http://\S+) ", line)
        assert match, line
        self.url = match.group(1)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)


class EngineServer(CliServer):
    """``python -m kvstore.cli engine ...`` in a subprocess; ``url`` is its http://host:port."""

    def __init__(self, *args: str, model: str | None = None, env: dict[str, str] | None = None) -> None:
        which = ["--model", model, "--kv-cache", "4MiB"] if model else ENGINE_ARGS
        store = [] if "--store-url" in args else EMBEDDED_ARGS
        super().__init__(["engine", *which, *store, "--port", "0", *args], timeout=120, env=env)
        # ready means bound; /health means serving
        wait_until(lambda: httpx.get(f"{self.url}/health", timeout=2).status_code == 200,
                   max(0.0, self.deadline - time.monotonic()), lambda: f"/health answering: {self.output}",
                   ignoring=(httpx.HTTPError,))

    def client(self, api_key: str = "unused", **kw: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kw)

    def load(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/v1/kvstore/load", timeout=5).json()

    def wait_idle(self, timeout: float = 20.0) -> dict[str, Any]:
        """The load once nothing runs, waits or holds a device block."""

        load: dict[str, Any] = {}

        def idle() -> dict[str, Any] | None:
            load.update(self.load())
            busy = load["running"] or load["waiting"] or load["loading"] or load["kv_usage"] != 0
            return None if busy else dict(load)

        return wait_until(idle, timeout, lambda: f"{self.url} idle (load {load})")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def reference_engine() -> Any:
    """An in-process LLMEngine with the server's model, seed and block size."""
    from kvstore.engine import LLMEngine

    return LLMEngine(None, random_model=TINY, seed=3, block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
                     kv_cache_bytes=4 << 20, host_bytes=0, dtype=torch.float32)


class InProcessServer:
    """``kvstore engine --random-model`` (the tests' model, seed and block size) built as the
    process builds it, served by uvicorn on a free loopback port from a thread; ``llm`` is the
    engine it serves. ``kv_cache_bytes`` sizes the device pool (small: preemption)."""

    def __init__(self, kv_cache_bytes: int = 4 << 20) -> None:
        from kvstore.config import StoreSettings
        from kvstore.services.common.http import bind, uvicorn_server, where
        from kvstore.services.engine_server.app import create_app
        from kvstore.services.engine_server.config import EngineServerConfig
        from kvstore.services.engine_server.server import build_state

        config = EngineServerConfig(random_config=TINY, port=0, store_settings=StoreSettings(host_bytes=8 << 20),
                             kv_cache_bytes=kv_cache_bytes, block_size=BLOCK, max_model_len=MAX_MODEL_LEN, seed=3)
        self.state = build_state(config)
        self.llm = self.state.loop.llm
        sock = bind("127.0.0.1", 0)
        self.url = f"http://{where(sock)}"
        self.server = uvicorn_server(create_app(self.state))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[sock])), daemon=True)
        self.thread.start()
        wait_serving(self.server, self.thread)

    def client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.state.loop.stop()
