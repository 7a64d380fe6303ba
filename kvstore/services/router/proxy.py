"""Forwarding one OpenAI request to the replica the Router picked, whole or streamed.

The caller's body goes to the replica byte for byte; only the headers change: the router's
secret (``Authorization: Bearer <router token>``) and the caller's tenant
(``X-KVStore-Tenant``). A stream is passed through as the replica sends it, in whole SSE
events. A forward that never reached the replica (connection refused or timed out, or a
replica draining with 503) did not start anything there, so it is routed again, to another
replica, up to ``max_attempts``; the unreachable replica is taken out at once. Anything that
failed after the replica took the request is the caller's answer (nothing runs twice): a
whole answer becomes a 502, a broken stream ends with OpenAI's error event (its client
raises). A caller that goes away is gone for the replica too: the router drops its
connection there, and the replica aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvstore.services.router.policy import Decision, Router, RoutingError

log = logging.getLogger("kvstore.services.router")
TENANT_HEADER = "X-KVStore-Tenant"
RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout)
GONE = 499  # the status of a request whose caller went away (as the engine counts it)
DISCONNECT_POLL_S = 0.25  # how often a caller waiting for a whole answer is checked (as the engine does)
SSE_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")
T = TypeVar("T")


def error_body(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    """OpenAI's error shape, as a response."""
    return JSONResponse(error_body(message, kind, code), status_code=status)


class BrokenStream(Exception):
    """A stream that is not SSE broke mid-body: raised into the server, which cuts the caller's
    connection (a body that just ended would read as complete)."""


@dataclass
class Forward:
    """One request to forward: where it goes in the replica's API and what it carries."""

    endpoint: str  # "completion" or "chat"
    path: str  # /v1/completions or /v1/chat/completions
    body: bytes
    stream: bool
    tokens: list[int]
    tenant: str
    is_disconnected: Callable[[], Awaitable[bool]] | None = None  # the caller's (Request.is_disconnected)


class Proxy:
    """Routes and forwards requests; ``on_unreachable(url, why)`` takes a replica out.
    ``num_streams`` counts the streams being relayed (a drain waits for them)."""

    def __init__(self, router: Router, client: httpx.AsyncClient, router_token: str | None, max_attempts: int,
                 on_unreachable: Callable[[str, str], None], metrics: Any) -> None:
        self.router, self.client = router, client
        self.router_token, self.max_attempts = router_token, max_attempts
        self.on_unreachable, self.metrics = on_unreachable, metrics
        self.num_streams = 0

    def headers(self, tenant: str) -> dict[str, str]:
        out = {"content-type": "application/json"}
        if self.router_token:
            out["authorization"] = f"Bearer {self.router_token}"
            out[TENANT_HEADER] = tenant
        return out

    async def forward(self, fwd: Forward) -> Response:
        """The caller's answer: the replica's (whole, or a ``RelayedStream``, which counts
        itself in the metrics when it ends), or the router's own error."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                decision = self.router.route(fwd.tokens, fwd.tenant)
            except RoutingError as exc:
                return error(503, str(exc), "service_unavailable_error", "no_replica")
            self.metrics.decided(decision)
            request = self.client.build_request("POST", decision.replica + fwd.path, content=fwd.body,
                                                headers=self.headers(fwd.tenant))
            try:
                upstream = await self._unless_gone(self.client.send(request, stream=True), fwd)
            except RETRYABLE as exc:
                self.router.finished(decision, prefill_done=False)
                self.on_unreachable(decision.replica, f"connection failed ({type(exc).__name__})")
                self.metrics.retried(fwd.endpoint)
                continue
            except httpx.HTTPError as exc:
                self.router.finished(decision, prefill_done=False)
                return error(502, f"replica {decision.replica} failed: {type(exc).__name__}", "server_error")
            if upstream is None:
                self.router.finished(decision, prefill_done=False)
                return Response(status_code=GONE)
            if upstream.status_code == 503 and attempt < self.max_attempts:  # draining: nothing started
                await upstream.aclose()
                self.router.finished(decision, prefill_done=False)
                self.on_unreachable(decision.replica, "draining (503)")
                self.metrics.retried(fwd.endpoint)
                continue
            if fwd.stream and upstream.status_code == 200:
                return RelayedStream(Relay(self, upstream, decision, fwd))
            try:
                content = await self._unless_gone(upstream.aread(), fwd)
            except httpx.HTTPError as exc:
                return error(502, f"replica {decision.replica} failed: {type(exc).__name__}", "server_error")
            finally:
                await upstream.aclose()
                self.router.finished(decision, prefill_done=False)
            if content is None:
                return Response(status_code=GONE)
            if upstream.status_code == 200:
                self.metrics.observed_cached(decision, _cached_tokens(content))
            return Response(content, status_code=upstream.status_code, headers=route_headers(decision),
                            media_type=upstream.headers.get("content-type", "application/json"))
        return error(503, f"no replica could be reached in {self.max_attempts} attempts", "service_unavailable_error",
                     "no_replica")

    async def _unless_gone(self, work: Coroutine[Any, Any, T], fwd: Forward) -> T | None:
        """``work``'s result, or None if the caller goes away first: ``work`` is then cancelled,
        which drops its connection to the replica, so the replica sees its caller gone too."""
        if fwd.is_disconnected is None:
            return await work
        task = asyncio.ensure_future(work)
        try:
            while not (await asyncio.wait([task], timeout=DISCONNECT_POLL_S))[0]:
                if await fwd.is_disconnected():
                    task.cancel()
                    await asyncio.wait([task])
                    late = None if task.cancelled() or task.exception() else task.result()
                    if isinstance(late, httpx.Response):  # it came just as the caller left
                        await late.aclose()
                    return None
            return task.result()
        finally:
            task.cancel()  # a no-op once it is done; else this coroutine itself is cancelled


class Relay:
    """One replica stream on its way to the caller (``RelayedStream`` sends it)."""

    def __init__(self, proxy: Proxy, upstream: httpx.Response, decision: Decision, fwd: Forward) -> None:
        self.proxy, self.upstream, self.decision, self.fwd = proxy, upstream, decision, fwd
        self.is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        self.got_token = False
        self.status = GONE  # until the body ends (200) or breaks (502)
        self.tail = b""  # the usage chunk, if any, is near the end
        self.closed = False
        proxy.num_streams += 1

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The replica's body as it comes (an SSE body in whole events). The first event that
        is not a chat stream's opening role chunk (sent before the prefill) carries the first
        token: prefill is over. If the replica's body breaks, an SSE caller gets OpenAI's
        error event and then the end of the body, so that its client raises (never a cut-off
        generation that reads as complete, nor half an event); any other caller gets its
        connection cut (``BrokenStream``)."""
        pending = b""
        try:
            async for chunk in self.upstream.aiter_raw():
                if self.is_sse:
                    pending += chunk
                    end = _whole_events(pending)
                    chunk, pending = pending[:end], pending[end:]
                    if not chunk:
                        continue
                if not self.got_token and chunk.count(b"data: ") > chunk.count(b'"role"'):
                    self.proxy.router.prefill_done(self.decision)
                    self.got_token = True
                self.tail = (self.tail + chunk)[-65536:]
                yield chunk
            if pending:  # the replica ended its body inside an event: passed on as it is
                yield pending
            self.status = 200
        except httpx.HTTPError as exc:
            self.status = 502
            why = f"the stream from replica {self.decision.replica} broke: {type(exc).__name__}"
            log.warning("%s", why)
            if not self.is_sse:
                raise BrokenStream(why) from None
            yield b"data: " + json.dumps(error_body(why, "server_error")).encode() + b"\n\n"
        finally:
            await self.close()

    async def close(self) -> None:
        """Once, however the stream ended: the Router and the metrics told, the stream out of
        ``num_streams``, the replica's response closed (its connection dropped, if unfinished)."""
        if self.closed:
            return
        self.closed = True
        self.proxy.num_streams -= 1
        self.proxy.router.finished(self.decision, prefill_done=self.got_token)
        self.proxy.metrics.request_done(self.fwd.endpoint, self.status)
        self.proxy.metrics.observed_cached(self.decision, _stream_cached_tokens(self.tail))
        await self.upstream.aclose()


class RelayedStream(StreamingResponse):
    """A ``Relay`` as the caller's response. The relay is closed when the response is over,
    however it ended: body done or broken, caller gone, or never begun."""

    def __init__(self, relay: Relay) -> None:
        self.relay, self.chunks = relay, relay.chunks()
        super().__init__(self.chunks, status_code=200, headers=route_headers(relay.decision),
                         media_type=relay.upstream.headers.get("content-type", "text/event-stream"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.chunks.aclose()
            await self.relay.close()


def route_headers(decision: Decision) -> dict[str, str]:
    """What the router decided, for the caller (and tests): replica, reason, predicted cache."""
    return {"x-kvstore-replica": decision.replica, "x-kvstore-route-reason": decision.reason,
            "x-kvstore-predicted-cached-tokens": str(decision.predicted_cached_tokens)}


def _whole_events(data: bytes) -> int:
    """The length of ``data``'s leading whole SSE events (up to its last blank line; 0: none)."""
    ends = [(data.rfind(sep), len(sep)) for sep in SSE_EVENT_ENDS]
    return max((at + n for at, n in ends if at >= 0), default=0)


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
