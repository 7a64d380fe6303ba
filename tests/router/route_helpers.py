"""Real parts for the router tests: ``kvstore engine`` replicas (the server tests' helper, with
KV events on fixed ports so that a restarted replica keeps its URL and endpoints), ``kvstore
route`` in front of them (a process, or its own ``run`` on a thread of this process), and
``FakeReplica``, a small ASGI replica on a real uvicorn server for the faults an engine cannot
be made to show on demand."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvstore.services.common.http import bind, uvicorn_server
from kvstore.services.router.config import RouteConfig
from kvstore.services.router.server import run
from kvstore.tools.bench.ports import free_port_pair

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "engine" / "serve"))

from serve_helpers import BLOCK, ENGINE_ARGS, MAX_MODEL_LEN, CliServer, EngineServer  # noqa: E402
from waiting import wait_serving, wait_until  # noqa: E402

ROUTER_TOKEN = "router-secret-5678"
__all__ = ["BLOCK", "ENGINE_ARGS", "MAX_MODEL_LEN", "ROUTER_TOKEN", "EngineServer", "FakeReplica", "Replica",
           "RouterProcess", "RouterThread", "free_ports", "metrics"]


def free_ports(count: int) -> list[int]:
    """``count`` TCP ports, each followed by a free one (a KV-events replay port), none handed
    out before in this process, below Linux's ephemeral range (kvstore.tools.bench.ports)."""
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
        load: dict[str, Any] = {}

        def idle() -> bool:
            load.update(httpx.get(f"{self.url}/v1/kvstore/load", timeout=5,
                                  headers={"authorization": f"Bearer {ROUTER_TOKEN}"}).json())
            return not (load["running"] or load["waiting"] or load["loading"]) and load["kv_usage"] == 0

        wait_until(idle, timeout, lambda: f"{self.url} idle (load {load})")

    def kill(self) -> None:
        if self.server is not None:
            self.server.kill()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


class RouterViews:
    """What a test reads from a router at ``url``: an ``openai`` client and its replicas' view."""

    url: str

    def client(self, api_key: str = "unused") -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def replicas(self) -> dict[str, Any]:
        """``GET /v1/router/replicas``, by URL."""
        view = httpx.get(f"{self.url}/v1/router/replicas", timeout=5).json()
        return {r["url"]: r for r in view["replicas"]}

    def wait_for(self, predicate: Callable[[dict[str, Any]], object], timeout: float = 30.0,
                 what: str = "") -> dict[str, Any]:
        """The router's replicas view once ``predicate`` holds of it (``wait_until`` over ``replicas``)."""
        view: dict[str, Any] = {}

        def holds() -> list[dict[str, Any]]:  # a one-item list: true even for an empty view
            view.clear()
            view.update(self.replicas())
            return [dict(view)] if predicate(view) else []

        def said() -> str:
            return f"router: {what} ({view})\n{getattr(self, 'output', '')}"

        return wait_until(holds, timeout, said)[0]


class RouterProcess(RouterViews, CliServer):
    """``python -m kvstore.cli route ...`` on a free port; ``url`` once it printed ready."""

    def __init__(self, replicas: list[Replica], *args: str) -> None:
        super().__init__(["route", *[a for r in replicas for a in ("--replica", r.url)], "--port", "0",
                          "--router-token", ROUTER_TOKEN, *args], timeout=90)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


class RouterThread(RouterViews):
    """``kvstore route``'s own ``run`` (kvstore/services/router/server.py: app, proxy, health loop, uvicorn,
    drain) on a thread and event loop of its own, without a process start. ``drain()`` does
    what SIGTERM does; ``close()`` drains and returns run's exit status."""

    def __init__(self, replicas: list[str], **config: Any) -> None:
        config = {"router_token": ROUTER_TOKEN, "health_interval_s": 0.05, **config}
        self.config = RouteConfig(tuple(replicas), port=free_port_pair(), **config)
        self.url = f"http://127.0.0.1:{self.config.port}"
        self.status: int | None = None
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        self.thread = threading.Thread(target=self._run, name="router", daemon=True)
        self.thread.start()

        def answers() -> bool:  # up once it answers, healthy or not
            if not self.thread.is_alive():
                raise RuntimeError(f"the router did not start (status {self.status})")
            httpx.get(f"{self.url}/health", timeout=1)
            return True

        wait_until(answers, 30, "the router answering", ignoring=(httpx.HTTPError,))

    def _run(self) -> None:
        loop = self.loop
        try:
            self.status = loop.run_until_complete(run(self.config, self.stop))
        finally:
            loop.run_until_complete(_wind_down())
            loop.close()

    def drain(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)

    def close(self, timeout: float = 30.0) -> int | None:
        if self.thread.is_alive():
            self.drain()
            self.thread.join(timeout)
        return self.status


async def _wind_down() -> None:
    """What ``asyncio.run`` does after its coroutine, as ``kvstore route`` runs it: the tasks left
    are cancelled and awaited, then the async generators and the default executor shut down."""
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)
    loop = asyncio.get_running_loop()
    await loop.shutdown_asyncgens()
    await loop.shutdown_default_executor()


def metrics(url: str) -> dict[str, float]:
    """A server's ``/metrics`` samples by name and labels."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and line[0] != "#"}


# ---------------------------------------------------------------------------------------------
# FakeReplica

FAKE_INFO: dict[str, Any] = {
    "model": "random", "engine_id": "fake", "block_size": BLOCK, "max_model_len": MAX_MODEL_LEN,
    "namespace": {"model_id": "random:fake", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16,
                  "dtype": "float32", "block_size": BLOCK, "tp_rank": 0, "tp_size": 1, "hash_algo": "sha256"},
    "tokenizer": {"kind": "bytes"}, "kv_events": None,
}
IDLE_LOAD: dict[str, Any] = {"running": 0, "waiting": 0, "loading": 0, "queued_prefill_tokens": 0,
                             "running_decode_seqs": 0, "kv_usage": 0.0, "num_free_blocks": 1000}
Answer = Callable[[Request, dict[str, Any]], Awaitable[Response]]


class Cut(Exception):
    """Raised by a fake's body mid-response: uvicorn drops the connection, as a killed replica's
    kernel does."""


class FakeReplica:
    """A replica that answers ``/v1/kvstore/{info,load,tokenize}`` as ``kvstore engine`` does
    (``load`` and ``tokenize_reply`` settable; ``load_status`` other than 200 makes it unhealthy)
    and its generation endpoints with ``answer(request, body)``. ``bodies`` records the
    generation bodies it received, ``disconnects`` counts callers that went away while an
    ``until_disconnected`` answer waited (it watches as the engine does)."""

    def __init__(self, tokenizer: str = "bytes") -> None:
        self.port = free_port_pair()
        self.info = {**FAKE_INFO, "tokenizer": {"kind": tokenizer}}
        self.load: dict[str, Any] = dict(IDLE_LOAD)
        self.load_status = 200
        self.tokenize_reply: Response | None = None
        self.answer: Answer = completion()
        self.bodies: list[dict[str, Any]] = []
        self.disconnects = 0
        app = Starlette(routes=[
            Route("/v1/kvstore/info", self._info), Route("/v1/kvstore/load", self._load),
            Route("/v1/kvstore/tokenize", self._tokenize, methods=["POST"]),
            Route("/v1/completions", self._generate, methods=["POST"]),
            Route("/v1/chat/completions", self._generate, methods=["POST"])])
        self.server = uvicorn_server(app)
        sock = bind("127.0.0.1", self.port)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[sock])),
                                       name=f"fake-replica-{self.port}", daemon=True)
        self.thread.start()
        wait_serving(self.server, self.thread)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _info(self, _request: Request) -> Response:
        return JSONResponse(self.info)

    async def _load(self, _request: Request) -> Response:
        return JSONResponse(self.load, status_code=self.load_status)

    async def _tokenize(self, request: Request) -> Response:
        if self.tokenize_reply is not None:
            return self.tokenize_reply
        body = await request.json()
        return JSONResponse({"tokens": list(json.dumps(body).encode())})

    async def _generate(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.bodies.append(body)
        return await self.answer(request, body)

    def stop(self) -> None:
        """Stop serving: connections to it are refused from now on."""
        self.server.should_exit = True
        self.thread.join(10)


def completion(status: int = 200, hold_s: float = 0.0) -> Answer:
    """A whole completion body (or, for a status other than 200, an OpenAI error), after ``hold_s``."""

    async def answer(_request: Request, _body: dict[str, Any]) -> Response:
        await asyncio.sleep(hold_s)  # a replica slow to answer, where a test asks for one
        if status != 200:
            return JSONResponse({"error": {"message": "refused", "type": "invalid_request_error", "param": "prompt",
                                           "code": None}}, status_code=status)
        return JSONResponse({"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "random",
                             "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    return answer


def sse_event(i: int) -> bytes:
    """One completion stream chunk carrying the text ``t{i}``."""
    chunk = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "random",
             "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None, "logprobs": None}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def stream(num_events: int, interval_s: float = 0.0, cut_after: bytes | None = None,
           media_type: str = "text/event-stream") -> Answer:
    """``num_events`` SSE chunks, ``interval_s`` apart; then ``[DONE]``, or, with ``cut_after``,
    those bytes (half an event, say) and the connection dropped."""

    async def body() -> AsyncIterator[bytes]:
        for i in range(num_events):
            yield sse_event(i)
            await asyncio.sleep(interval_s)  # the replica's pace of events, as the test sets it
        if cut_after is None:
            yield b"data: [DONE]\n\n"
            return
        if cut_after:
            yield cut_after  # sent once this resumes; uvicorn closes (not aborts) the connection: they leave
        raise Cut("the replica died mid-stream")

    async def answer(_request: Request, _body: dict[str, Any]) -> Response:
        return StreamingResponse(body(), media_type=media_type)

    return answer


def until_disconnected(fake: FakeReplica) -> Answer:
    """Nothing until the caller goes away (polled as the engine does), then counted."""

    async def answer(request: Request, _body: dict[str, Any]) -> Response:
        while not await request.is_disconnected():
            await asyncio.sleep(0.02)  # the engine's own poll of its caller, modelled
        fake.disconnects += 1
        return Response(status_code=499)

    return answer
