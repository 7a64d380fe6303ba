"""The FastAPI app of ``kvstore route``: the same OpenAI endpoints as ``kvstore engine``,
forwarded to the replica the Router picks, plus the router's own views (docs/routing.md).

``RouteState`` holds the replicas' links, the Router (built once the first replica has told
its key recipe), the HTTP client and the callers' tokens; ``health_loop`` polls every replica.
A request: authenticate the caller (its tenant), tokenize the prompt as the replicas do (bytes
locally; otherwise, and for chat templates, a replica's ``/v1/kvstore/tokenize``), hash and
route it (kvstore.services.router.policy), forward it (proxy.py). Every answer is counted with its final
status (a relayed stream when it ends).
"""

from __future__ import annotations

import asyncio
import json
import logging
from importlib.resources import files
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from kvstore.keys import BlockHasher
from kvstore.services.common.tokens import AuthError, Tokens
from kvstore.services.router.config import RouteConfig
from kvstore.services.router.metrics import RouteMetrics
from kvstore.services.router.policy import ROUND_ROBIN, Router
from kvstore.services.router.proxy import Forward, Proxy, RelayedStream, error
from kvstore.services.router.replica import ReplicaInfo, ReplicaLink

log = logging.getLogger("kvstore.services.router")
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


class RouteState:
    """Everything the handlers share (see module)."""

    def __init__(self, config: RouteConfig) -> None:
        self.config = config
        headers = {"authorization": f"Bearer {config.router_token}"} if config.router_token else {}
        self.links = {url: ReplicaLink(url, headers, config.health_interval_s, config.dead_after_s)
                      for url in config.urls}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=config.connect_timeout_s),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.tokens = Tokens(None, config.tokens_file)
        self.router: Router | None = None
        self.recipe: ReplicaInfo | None = None
        self.proxy: Proxy | None = None
        self.metrics = RouteMetrics(lambda: self.router, lambda: {u: link.healthy for u, link in self.links.items()})
        self.draining = False
        self.num_routing = 0  # requests being tokenized, routed or forwarded

    @property
    def num_inflight(self) -> int:
        """Requests being routed or forwarded and streams still relayed: what a drain waits for."""
        return self.num_routing + (self.proxy.num_streams if self.proxy is not None else 0)

    async def learn_recipe(self, timeout_s: float) -> None:
        """Wait for the first replica that answers its info: its key recipe is the pool's."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        problems: dict[str, str] = {}
        while self.router is None:
            for link in self.links.values():
                try:
                    info = await link.learn(self.client)
                except (httpx.HTTPError, ValueError) as exc:
                    problems[link.url] = f"{type(exc).__name__}: {exc}"
                    continue
                self.recipe = info
                self.router = Router(info.block_size, self.config.routing, BlockHasher(info.namespace))
                for url in self.links:
                    self.router.add_replica(url)
                    self.router.set_healthy(url, False)  # each comes in through its first health check
                self.proxy = Proxy(self.router, self.client, self.config.router_token, self.config.max_attempts,
                                   self.take_out, self.metrics)
                break
            if self.router is None:
                if loop.time() > deadline:
                    raise RuntimeError("no replica answered GET /v1/kvstore/info: "
                                       + "; ".join(f"{u}: {p}" for u, p in problems.items()))
                await asyncio.sleep(self.config.health_interval_s)

    async def check_all(self) -> None:
        assert self.router is not None and self.recipe is not None
        await asyncio.gather(*(link.check(self.client, self.router, self.recipe) for link in self.links.values()))

    async def health_loop(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:
                log.exception("health round failed")
            await asyncio.sleep(self.config.health_interval_s)

    def take_out(self, url: str, why: str) -> None:
        link = self.links.get(url)
        if link is not None and link.healthy and self.router is not None:
            link.take_out(self.router, why)

    def healthy_urls(self) -> list[str]:
        return [u for u, link in self.links.items() if link.healthy]

    async def tokenize(self, endpoint: str, body: dict[str, Any], tenant: str) -> list[int]:
        """The first prompt's token ids as the replicas see them ([] when they cannot be known,
        or are no token ids: the request is routed without a prefix, and the replica answers a
        bad request itself)."""
        assert self.recipe is not None
        if endpoint == "completion":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
                prompt = prompt[0]  # a batch is routed by its first prompt
            if isinstance(prompt, list):
                return token_ids(prompt)
            if not isinstance(prompt, str):
                return []
            if self.recipe.tokenizer_kind == "bytes":
                try:
                    return list(prompt.encode("utf-8"))
                except UnicodeEncodeError:  # a lone surrogate: no text the replica can run
                    return []
            request: dict[str, Any] = {"prompt": prompt}
        else:
            if not isinstance(body.get("messages"), list):
                return []
            request = {"messages": body["messages"]}
        assert self.proxy is not None
        for url in self.healthy_urls():
            try:
                response = await self.client.post(f"{url}/v1/kvstore/tokenize", json=request,
                                                  headers=self.proxy.headers(tenant))
            except httpx.HTTPError:
                continue
            if response.status_code != 200:
                return []  # the replica refuses the prompt: it will say why when it gets the request
            try:
                reply = response.json()
            except ValueError:  # not JSON: a replica (or a proxy in front of it) gone wrong
                return []
            return token_ids(reply.get("tokens") if isinstance(reply, dict) else None)
        return []

    def replicas_view(self) -> dict[str, Any]:
        router = self.router
        return {"policy": self.config.routing.policy,
                "block_size": self.recipe.block_size if self.recipe else None,
                "kv_groups": [{"kind": g.kind, "layers": list(g.layers), "window": g.window}
                              for g in self.recipe.namespace.layout.kv_groups] if self.recipe else [],
                "model": self.recipe.model if self.recipe else None,
                "decisions": dict(router.reasons) if router else {},
                "replicas": [link.status(router) for link in self.links.values()] if router else []}

    async def close(self) -> None:
        for link in self.links.values():
            link.close()
        await self.client.aclose()


def token_ids(value: Any) -> list[int]:
    """``value`` if it is a list of token ids the router can hash (ints in [0, 2**32)), else []."""
    if isinstance(value, list) and all(type(t) is int and 0 <= t < 1 << 32 for t in value):
        return value
    return []


def create_app(state: RouteState) -> FastAPI:
    app = FastAPI(title="kvstore route", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.route = state
    page = files("kvstore.services.router").joinpath("static/router.html").read_text(encoding="utf-8")

    def tenant_of(request: Request) -> str:
        if state.tokens.is_open:  # no --tokens: every caller is tenant "", whatever it sends
            return ""
        header = request.headers.get("authorization")
        token = None
        if header:
            scheme, _, value = header.partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                raise AuthError("the Authorization header must be 'Bearer <token>'")
            token = value.strip()
        return state.tokens.authenticate(token).tenant

    async def generation(request: Request, endpoint: str) -> Response:
        try:
            response = await answer(request, endpoint)
        except Exception:
            log.exception("%s failed", endpoint)
            response = error(500, "the router failed on this request", "server_error")
        if not isinstance(response, RelayedStream):  # a stream counts itself when it ends
            state.metrics.request_done(endpoint, response.status_code)
        return response

    async def answer(request: Request, endpoint: str) -> Response:
        if state.draining:
            return error(503, "the router is shutting down and takes no new requests", "service_unavailable_error",
                         "draining")
        try:
            tenant = tenant_of(request)
        except AuthError as exc:
            return error(401, str(exc), "authentication_error", "invalid_api_key")
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object", "invalid_request_error")
        assert state.proxy is not None
        state.num_routing += 1
        try:
            # round robin reads neither cache nor load: it needs no tokens (nor their round trip);
            # least_loaded needs the prompt's length, its prefill, in the load it weighs
            tokens = await state.tokenize(endpoint, body, tenant) if state.config.routing.policy != ROUND_ROBIN else []
            return await state.proxy.forward(Forward(endpoint, PATHS[endpoint], raw, body.get("stream") is True,
                                                     tokens, tenant, request.is_disconnected))
        finally:
            state.num_routing -= 1

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generation(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            tenant_of(request)
        except AuthError as exc:
            return error(401, str(exc), "authentication_error", "invalid_api_key")
        assert state.proxy is not None
        for url in state.healthy_urls():
            try:
                upstream = await state.client.get(f"{url}/v1/models", headers=state.proxy.headers(""))
            except httpx.HTTPError:
                continue
            return Response(upstream.content, upstream.status_code, media_type="application/json")
        return error(503, "no healthy replica", "service_unavailable_error", "no_replica")

    @app.get("/health")
    async def health() -> Response:
        healthy = state.healthy_urls()
        ok = bool(healthy) and not state.draining
        return JSONResponse({"status": "ok" if ok else "unavailable", "healthy_replicas": len(healthy)},
                            status_code=200 if ok else 503)

    @app.get("/v1/router/replicas")
    async def replicas() -> Response:
        return JSONResponse(state.replicas_view())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/router")
    async def router_page() -> Response:
        return HTMLResponse(page)

    return app
