"""The ``kvstore engine`` process: build the engine, start its loop thread, serve the app with
uvicorn, and drain on SIGTERM.

Lifecycle: load the model and open the store -> start the engine loop -> bind -> print
``kvstore engine: serving NAME on http://HOST:PORT (pid N); ready`` -> serve -> SIGTERM/SIGINT: new requests
(and /health) get 503, requests in flight finish (up to ``drain_s``; then they are cancelled
and aborted), the loop stops, the engine closes (its device cache is written back to the
store) and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

from kvstore.policy.quotas import QuotaTable
from kvstore.services.common.http import bind, freeze_start_heap, stop_on_signals, uvicorn_server, where
from kvstore.services.engine_server.app import create_app
from kvstore.services.engine_server.auth import Auth
from kvstore.services.engine_server.config import EngineServerConfig
from kvstore.services.engine_server.loop import EngineLoop
from kvstore.services.engine_server.state import ServerState
from kvstore.services.engine_server.tokenizer import load_tokenizer
from kvstore.store import TieredStore

log = logging.getLogger("kvstore.services.engine_server")


def kv_events_info(llm: Any) -> dict[str, Any]:
    """The KV events publisher's bound addresses and topic for /v1/kvstore/info (null: none)."""
    if llm.kv_events is None:
        return {"endpoint": None, "replay_endpoint": None, "topic": ""}
    info = llm.kv_events.info()
    return {"endpoint": info["endpoint"], "replay_endpoint": info["replay_endpoint"], "topic": info["topic"]}


def build_state(config: EngineServerConfig) -> ServerState:
    """Load the model, open the store, start the engine loop (the slow part of a start)."""
    from kvstore.engine.llm import LLMEngine

    llm = LLMEngine(config.model, **config.engine_kwargs())
    try:
        tokenizer = load_tokenizer(config.model, llm.tokenizer)
        auth = Auth(config.tokens_file, config.router_token)
        if isinstance(llm.store, TieredStore) and auth.tokens.tenants:
            # the embedded store: the tokens file's tenants get equal soft shares of every tier,
            # as a daemon gives them (docs/eviction.md, "Quotas"); a daemon's store sets its own
            llm.store.set_quotas(QuotaTable.equal_shares(auth.tokens.tenants))
    except Exception:
        llm.close()
        raise
    loop = EngineLoop(llm)
    loop.start()
    return ServerState(loop, tokenizer, auth, config.model_name, kv_events_info(llm))


async def run(config: EngineServerConfig) -> int:
    aloop = asyncio.get_running_loop()
    stop = stop_on_signals(aloop)
    sock = bind(config.host, config.port)  # before the model loads: a taken port fails at once
    state = await aloop.run_in_executor(None, build_state, config)
    server = uvicorn_server(create_app(state))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not (server.started or task.done()):
        await asyncio.sleep(0.01)
    if not server.started:
        await aloop.run_in_executor(None, state.loop.stop)
        await task  # raises what stopped it
        return 1
    freeze_start_heap()
    print(f"kvstore engine: serving {state.model_name!r} on http://{where(sock)} (pid {os.getpid()}); ready",
          flush=True)
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


def serve(config: EngineServerConfig) -> int:
    """Run ``kvstore engine`` in this process until SIGTERM/SIGINT; returns the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(run(config))
