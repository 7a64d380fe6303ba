"""The FastAPI app of ``kvstore engine``: OpenAI's completions, chat, models; health, metrics;
and kvstore's replica endpoints for a router (info, load, tokenize). docs/serving.md.

A handler authenticates (tenant), validates the body, tokenizes, checks every prompt against
the engine, then submits one engine request per prompt to the EngineLoop. Outputs come back
through an asyncio queue (the loop thread calls ``call_soon_threadsafe``); each becomes deltas
(engine/serve/generation.py), streamed as SSE or gathered into one body. A client that goes
away, or a request whose samples all hit stop strings, is aborted in the engine at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from engine.sampling import SamplingParams
from engine.sequence import RequestOutput
from engine.serve.auth import TENANT_HEADER, Auth
from engine.serve.errors import APIError, bad_request, draining
from engine.serve.generation import Generation
from engine.serve.loop import EngineLoop
from engine.serve.metrics import ServerMetrics
from engine.serve.responses import DONE, Shapes, sse
from engine.serve.schema import ChatCompletionRequest, CompletionRequest, SamplingFields, TokenizeRequest
from engine.serve.tokenizer import ServeTokenizer

log = logging.getLogger("kvstore.engine.serve")
DISCONNECT_POLL_S = 0.25
UNION_MESSAGES = {"prompt": "must be a string, a list of token ids, or a list of strings or of token id lists",
                  "stop": "must be a string or a list of strings"}


@dataclass
class ServerState:
    """Everything the handlers share; the server flips ``draining`` on SIGTERM."""

    loop: EngineLoop
    tokenizer: ServeTokenizer
    auth: Auth
    model_name: str
    kv_events: dict[str, Any]
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    num_inflight: int = 0
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(lambda: self.loop.load, self.loop.llm.kv_events)

    def info(self) -> dict[str, Any]:
        llm = self.loop.llm
        ns = llm.namespace
        layout = ns.layout
        return {"model": self.model_name, "engine_id": self.engine_id, "block_size": layout.block_size,
                "namespace": {"model_id": ns.model_id, "num_layers": layout.num_layers,
                              "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
                              "dtype": layout.dtype_name, "block_size": layout.block_size,
                              "tp_rank": layout.tp_rank, "tp_size": layout.tp_size, "hash_algo": ns.hash_algo},
                "tokenizer": self.tokenizer.info(), "kv_events": self.kv_events, "max_model_len": llm.max_model_len}


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _body(request: Request, model: type[BaseModel]) -> Any:
    """Parse and validate a JSON body; every failure is a 400 naming the field."""
    try:
        data = await request.json()
    except ValueError:
        raise bad_request("the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None
        msg = UNION_MESSAGES.get(param or "") if len(first["loc"]) > 1 else None
        msg = msg or first["msg"].removeprefix("Value error, ")
        raise bad_request(f"{param}: {msg}" if param else msg, param=param) from None


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kvstore engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    loop, tok, metrics = state.loop, state.tokenizer, state.metrics

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(APIError(exc.status_code, str(exc.detail), kind))

    def tenant_of(request: Request) -> str:
        return state.auth.tenant(request.headers.get("authorization"), request.headers.get(TENANT_HEADER))

    def counted(endpoint: str, fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            try:
                response = await fn(request)
            except APIError as exc:
                metrics.request_done(endpoint, exc.status)
                return _error(exc)
            except Exception:
                log.exception("%s failed", endpoint)
                metrics.request_done(endpoint, 500)
                return _error(APIError(500, "internal server error", "server_error"))
            if not isinstance(response, StreamingResponse):  # a stream counts itself when it ends
                metrics.request_done(endpoint, response.status_code)
            return response
        return handler

    # ------------------------------------------------------------------ generation

    def sampling(req: SamplingFields, max_tokens: int | None, prompt_len: int) -> SamplingParams:
        if max_tokens is None:
            max_tokens = max(1, loop.llm.max_model_len - prompt_len)
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=float(req.temperature), top_p=float(req.top_p),
                                  top_k=req.top_k, seed=req.seed, n=req.n, ignore_eos=req.ignore_eos)
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    def check_model(req: SamplingFields) -> None:
        if req.model is not None and req.model != state.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {state.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def prompt_ids(prompt: str | list[int], param: str) -> list[int]:
        ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
        try:
            return loop.llm.prompt_token_ids(ids)
        except ValueError as exc:
            raise bad_request(str(exc), param=param) from None

    async def generate(request: Request, kind: str, req: SamplingFields, prompts: list[list[int]],
                       max_tokens: int | None, tenant: str) -> Response:
        aloop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        shapes = Shapes(kind, f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}",
                        int(time.time()), state.model_name, req.include_usage)
        stops = req.stop_strings
        params = [sampling(req, max_tokens, len(ids)) for ids in prompts]
        gens: list[Generation] = []
        now = time.perf_counter()
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            gen = Generation("", ids, req.n, stops, tok, first_index=i * req.n, arrival_s=now)

            def sink(item: RequestOutput | BaseException, i: int = i) -> None:
                with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody is waiting
                    aloop.call_soon_threadsafe(queue.put_nowait, (i, item))

            gen.request_id = loop.submit(ids, p, tenant, sink)
            gens.append(gen)
        state.num_inflight += 1

        async def deltas() -> AsyncIterator[Any]:
            """The deltas of every generation as their outputs arrive, until all are done."""
            while not all(g.done for g in gens):
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                gen = gens[i]
                if gen.done:
                    continue
                for d in gen.update(item, time.perf_counter()):
                    yield d
                for gap in gen.gaps:
                    metrics.itl.observe(gap)
                gen.gaps.clear()
                if gen.done:
                    if not gen.closed:  # every sample hit a stop string: free the engine now
                        loop.abort(gen.request_id)
                        gen.closed = True
                    if gen.ttft_s is not None:
                        metrics.ttft.observe(gen.ttft_s)
                    metrics.generation_done(gen)

        def finish() -> None:
            for gen in gens:
                if not gen.closed:
                    loop.abort(gen.request_id)
                    gen.closed = True
            state.num_inflight -= 1

        if req.stream:
            async def events() -> AsyncIterator[bytes]:
                status = 200
                try:
                    for chunk in shapes.first_chunks(gens):
                        yield chunk
                    try:
                        async for d in deltas():
                            for chunk in shapes.chunks(d):
                                yield chunk
                    except ValueError as exc:
                        status = 400
                        yield sse(bad_request(str(exc)).body())
                    except Exception as exc:  # the engine failed: the stream ends with the error
                        log.exception("generation failed")
                        status = 500
                        yield sse(APIError(500, f"generation failed: {type(exc).__name__}", "server_error").body())
                    else:
                        if req.include_usage:
                            yield shapes.usage_chunk(gens)
                    yield DONE
                except asyncio.CancelledError:
                    status = 499  # the client went away
                    raise
                finally:
                    finish()
                    metrics.request_done(kind, status)

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        try:
            it = deltas().__aiter__()
            while True:
                step = asyncio.ensure_future(it.__anext__())
                while not step.done():
                    await asyncio.wait([step], timeout=DISCONNECT_POLL_S)
                    if not step.done() and await request.is_disconnected():
                        step.cancel()
                        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                            await step
                        return Response(status_code=499)
                try:
                    step.result()
                except StopAsyncIteration:
                    break
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        finally:
            finish()
        return JSONResponse(shapes.body(gens))

    async def completions(request: Request) -> Response:
        if state.draining:
            raise draining()
        tenant = tenant_of(request)
        req: CompletionRequest = await _body(request, CompletionRequest)
        check_model(req)
        prompts = req.prompts()
        if not prompts:
            raise bad_request("prompt is empty", param="prompt")
        ids = [prompt_ids(p, "prompt") for p in prompts]
        return await generate(request, "completion", req, ids, req.max_tokens, tenant)

    async def chat(request: Request) -> Response:
        if state.draining:
            raise draining()
        tenant = tenant_of(request)
        req: ChatCompletionRequest = await _body(request, ChatCompletionRequest)
        check_model(req)
        try:
            ids = tok.encode_chat([m.as_dict() for m in req.messages])
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None
        return await generate(request, "chat", req, [prompt_ids(ids, "messages")], req.max_new_tokens, tenant)

    app.add_api_route("/v1/completions", counted("completion", completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", counted("chat", chat), methods=["POST"])

    # ------------------------------------------------------------------ everything else

    async def models(request: Request) -> Response:
        tenant_of(request)
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "kvstore",
             "max_model_len": loop.llm.max_model_len}]})

    async def info(request: Request) -> Response:
        tenant_of(request)
        return JSONResponse(state.info())

    async def load(request: Request) -> Response:
        tenant_of(request)
        return JSONResponse(loop.load.public())

    async def tokenize(request: Request) -> Response:
        tenant_of(request)
        req: TokenizeRequest = await _body(request, TokenizeRequest)
        if req.messages is not None:
            try:
                return JSONResponse({"tokens": tok.encode_chat([m.as_dict() for m in req.messages])})
            except ValueError as exc:
                raise bad_request(str(exc), param="messages") from None
        assert req.prompt is not None
        return JSONResponse({"tokens": tok.encode(req.prompt) if isinstance(req.prompt, str) else req.prompt})

    async def health(_request: Request) -> Response:
        if state.draining:
            raise draining()
        return JSONResponse({"status": "ok"})

    async def prometheus(_request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_api_route("/v1/models", counted("models", models), methods=["GET"])
    app.add_api_route("/v1/kvstore/info", counted("info", info), methods=["GET"])
    app.add_api_route("/v1/kvstore/load", counted("load", load), methods=["GET"])
    app.add_api_route("/v1/kvstore/tokenize", counted("tokenize", tokenize), methods=["POST"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])
    return app
