"""The ``kvstore route`` process: learn the replicas, serve the app with uvicorn, drain on SIGTERM.

Lifecycle: wait for the first replica's ``/v1/kvstore/info`` (its key recipe is the pool's;
60 s at most) -> one health round (replicas that answer are taken in, their events followed)
-> bind -> print ``kvstore route: routing N replicas (M healthy) on http://HOST:PORT (pid P);
ready`` -> serve, with a health round every ``health_interval_s`` -> SIGTERM/SIGINT: new
requests get 503, requests in flight finish, streams to their last event (up to ``drain_s``), the
subscribers close and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from kvstore.services.common.http import bind, freeze_start_heap, stop_on_signals, uvicorn_server, where
from kvstore.services.router.app import RouteState, create_app
from kvstore.services.router.config import RouteConfig

RECIPE_TIMEOUT_S = 60.0


async def run(config: RouteConfig, stop: asyncio.Event | None = None) -> int:
    """Serve until ``stop`` is set (by default: the first SIGTERM/SIGINT), drain, return the exit status."""
    aloop = asyncio.get_running_loop()
    stop = stop if stop is not None else stop_on_signals(aloop)
    sock = bind(config.host, config.port)  # before learning the replicas: a taken port fails at once
    state = RouteState(config)
    try:
        await state.learn_recipe(RECIPE_TIMEOUT_S)
    except RuntimeError as exc:
        print(f"kvstore route: {exc}", flush=True)
        await state.close()
        sock.close()
        return 1
    await state.check_all()
    health = asyncio.create_task(state.health_loop())
    server = uvicorn_server(create_app(state))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not (server.started or task.done()):
        await asyncio.sleep(0.01)
    if not server.started:
        await task
        return 1
    freeze_start_heap()
    print(f"kvstore route: routing {len(state.links)} replicas ({len(state.healthy_urls())} healthy) with "
          f"{config.routing.policy} on http://{where(sock)} (pid {os.getpid()}); ready", flush=True)
    await stop.wait()
    state.draining = True
    deadline = time.monotonic() + config.drain_s
    while state.num_inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    server.should_exit = True
    with contextlib.suppress(asyncio.CancelledError):
        await task
    health.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await health
    await state.close()
    print("kvstore route: stopped", flush=True)
    return 0


def serve(config: RouteConfig) -> int:
    """Run ``kvstore route`` in this process until SIGTERM/SIGINT; returns the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(run(config))
