"""The ``kvstore engine`` process: build the engine, start its loop thread, serve the app with
uvicorn, and drain on SIGTERM.

Lifecycle: load the model and open the store -> start the engine loop -> bind -> print
``listening on http://HOST:PORT (pid N); ready`` -> serve -> SIGTERM/SIGINT: new requests
(and /health) get 503, requests in flight finish (up to ``drain_s``; then they are cancelled
and aborted), the loop stops, the engine closes (its device cache is written back to the
store) and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

from engine.serve.app import create_app
from engine.serve.auth import Auth
from engine.serve.config import ServeConfig
from engine.serve.loop import EngineLoop
from engine.serve.state import ServerState
from engine.serve.tokenizer import load_tokenizer
from kvstore.errors import ConfigError

log = logging.getLogger("kvstore.engine.serve")


def kv_events_info(llm: Any) -> dict[str, Any]:
    """The KV events publisher's bound addresses and topic for /v1/kvstore/info (null: none)."""
    if llm.kv_events is None:
        return {"endpoint": None, "replay_endpoint": None, "topic": ""}
    info = llm.kv_events.info()
    return {"endpoint": info["endpoint"], "replay_endpoint": info["replay_endpoint"], "topic": info["topic"]}


def build_state(config: ServeConfig) -> ServerState:
    """Load the model, open the store, start the engine loop (the slow part of a start)."""
    from engine.llm import LLMEngine

    llm = LLMEngine(config.model, **config.engine_kwargs())
    try:
        tokenizer = load_tokenizer(config.model, llm.tokenizer)
        auth = Auth(config.tokens_file, config.router_token)
    except Exception:
        llm.close()
        raise
    loop = EngineLoop(llm)
    loop.start()
    return ServerState(loop, tokenizer, auth, config.model_name, kv_events_info(llm))


def bind(host: str, port: int) -> socket.socket:
    """The listening socket. Raises ConfigError when the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that name it, and
    # without it Nagle holds each SSE chunk back until the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


async def run(config: ServeConfig) -> int:
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # run() owns the signals
            yield

    stop = asyncio.Event()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            os._exit(1)
        stop.set()

    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, on_signal)
    sock = bind(config.host, config.port)  # before the model loads: a taken port fails at once
    state = await aloop.run_in_executor(None, build_state, config)
    server = _Server(uvicorn.Config(create_app(state), log_level="warning", lifespan="off", access_log=False,
                                    timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not (server.started or task.done()):
        await asyncio.sleep(0.01)
    if not server.started:
        await aloop.run_in_executor(None, state.loop.stop)
        await task  # raises what stopped it
        return 1
    host, port = sock.getsockname()[:2]
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    print(f"kvstore engine: serving {state.model_name!r} on http://{where} (pid {os.getpid()}); ready", flush=True)
    await stop.wait()
    state.draining = True
    deadline = time.monotonic() + config.drain_s
    while state.num_inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if state.num_inflight:
        print(f"kvstore engine: {state.num_inflight} requests still running after {config.drain_s:.0f} s; "
              "cancelling them", flush=True)
    server.should_exit = True
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await aloop.run_in_executor(None, state.loop.stop)
    print("kvstore engine: stopped", flush=True)
    return 0


def serve(config: ServeConfig) -> int:
    """Run ``kvstore engine`` in this process until SIGTERM/SIGINT; returns the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(run(config))
