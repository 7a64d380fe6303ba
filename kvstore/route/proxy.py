"""Forwarding one OpenAI request to the replica the Router picked, whole or streamed.

The caller's body goes to the replica byte for byte; only the headers change: the router's
secret (``Authorization: Bearer <router token>``) and the caller's tenant
(``X-KVStore-Tenant``). A stream is passed through chunk by chunk as the replica sends it.
A forward that never reached the replica (connection refused or timed out, or a replica
draining with 503) did not start anything there, so it is routed again, to another replica,
up to ``max_attempts``; the unreachable replica is taken out at once. Anything that failed
after the replica took the request is the caller's answer (nothing runs twice).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvstore.routing import Decision, Router, RoutingError

log = logging.getLogger("kvstore.route")
TENANT_HEADER = "X-KVStore-Tenant"
RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout)


def error(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    """OpenAI's error shape."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status)


@dataclass
class Forward:
    """One request to forward: where it goes in the replica's API and what it carries."""

    endpoint: str  # "completion" or "chat"
    path: str  # /v1/completions or /v1/chat/completions
    body: bytes
    stream: bool
    tokens: list[int]
    tenant: str


class Proxy:
    """Routes and forwards requests; ``on_unreachable(url, why)`` takes a replica out."""

    def __init__(self, router: Router, client: httpx.AsyncClient, router_token: str | None, max_attempts: int,
                 on_unreachable: Callable[[str, str], None], metrics: Any) -> None:
        self.router, self.client = router, client
        self.router_token, self.max_attempts = router_token, max_attempts
        self.on_unreachable, self.metrics = on_unreachable, metrics

    def headers(self, tenant: str) -> dict[str, str]:
        out = {"content-type": "application/json"}
        if self.router_token:
            out["authorization"] = f"Bearer {self.router_token}"
            out[TENANT_HEADER] = tenant
        return out

    async def forward(self, fwd: Forward) -> Response:
        for attempt in range(1, self.max_attempts + 1):
            try:
                decision = self.router.route(fwd.tokens, fwd.tenant)
            except RoutingError as exc:
                return error(503, str(exc), "service_unavailable_error", "no_replica")
            self.metrics.decided(decision)
            request = self.client.build_request("POST", decision.replica + fwd.path, content=fwd.body,
                                                headers=self.headers(fwd.tenant))
            try:
                upstream = await self.client.send(request, stream=True)
            except RETRYABLE as exc:
                self.router.finished(decision, prefill_done=False)
                self.on_unreachable(decision.replica, f"connection failed ({type(exc).__name__})")
                self.metrics.retried(fwd.endpoint)
                continue
            except httpx.HTTPError as exc:
                self.router.finished(decision, prefill_done=False)
                return error(502, f"replica {decision.replica} failed: {type(exc).__name__}", "server_error")
            if upstream.status_code == 503 and attempt < self.max_attempts:  # draining: nothing started
                await upstream.aclose()
                self.router.finished(decision, prefill_done=False)
                self.on_unreachable(decision.replica, "draining (503)")
                self.metrics.retried(fwd.endpoint)
                continue
            if fwd.stream and upstream.status_code == 200:
                return StreamingResponse(self._relay(upstream, decision, fwd), status_code=200,
                                         media_type=upstream.headers.get("content-type", "text/event-stream"),
                                         headers=route_headers(decision))
            try:
                content = await upstream.aread()
            except httpx.HTTPError as exc:
                self.router.finished(decision, prefill_done=False)
                return error(502, f"replica {decision.replica} failed: {type(exc).__name__}", "server_error")
            finally:
                await upstream.aclose()
            self.router.finished(decision, prefill_done=False)
            self.metrics.request_done(fwd.endpoint, upstream.status_code)
            if upstream.status_code == 200:
                self.metrics.observed_cached(decision, _cached_tokens(content))
            return Response(content, status_code=upstream.status_code, headers=route_headers(decision),
                            media_type=upstream.headers.get("content-type", "application/json"))
        return error(503, f"no replica could be reached in {self.max_attempts} attempts", "service_unavailable_error",
                     "no_replica")

    async def _relay(self, upstream: httpx.Response, decision: Decision, fwd: Forward) -> AsyncIterator[bytes]:
        """The replica's stream, chunk by chunk. Its first event that is not a chat stream's
        opening role chunk (sent before the prefill) carries the first token: prefill is over."""
        first, tail, status = True, b"", 200
        try:
            async for chunk in upstream.aiter_raw():
                if first and chunk.count(b"data: ") > chunk.count(b'"role"'):
                    self.router.prefill_done(decision)
                    first = False
                tail = (tail + chunk)[-65536:]  # the usage chunk, if any, is near the end
                yield chunk
        except httpx.HTTPError as exc:
            status = 502
            log.warning("stream from %s broke: %s", decision.replica, type(exc).__name__)
        finally:
            await upstream.aclose()
            self.router.finished(decision, prefill_done=not first)
            self.metrics.request_done(fwd.endpoint, status)
            self.metrics.observed_cached(decision, _stream_cached_tokens(tail))


def route_headers(decision: Decision) -> dict[str, str]:
    """What the router decided, for the caller (and tests): replica, reason, predicted cache."""
    return {"x-kvstore-replica": decision.replica, "x-kvstore-route-reason": decision.reason,
            "x-kvstore-predicted-cached-tokens": str(decision.predicted_cached_tokens)}


def _cached_tokens(content: bytes) -> int | None:
    try:
        usage = json.loads(content).get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (ValueError, TypeError, AttributeError):
        return None
    return cached if isinstance(cached, int) else None


def _stream_cached_tokens(tail: bytes) -> int | None:
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line and b"cached_tokens" in line:
            return _cached_tokens(line[6:])
    return None
