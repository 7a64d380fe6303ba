"""The FastAPI app of ``kvstore engine``: OpenAI's completions, chat, models; health, metrics;
and kvstore's replica endpoints for a router (info, load, tokenize). docs/serving.md.

A handler authenticates (the tenant), validates the body, tokenizes, checks every prompt
against the engine (400 before anything is queued), then hands the prompts to a ``Run``
(kvstore/services/engine_server/runs.py), which streams or gathers the outputs. Every error is OpenAI's JSON.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from kvstore.engine.sampling import SamplingParams
from kvstore.services.engine_server.auth import TENANT_HEADER
from kvstore.services.engine_server.errors import APIError, bad_request, draining
from kvstore.services.engine_server.runs import Run
from kvstore.services.engine_server.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    TokenizeRequest,
)
from kvstore.services.engine_server.state import ServerState

log = logging.getLogger("kvstore.services.engine_server")
NO_STORE_HEADER = "x-kvstore-no-store"  # "1"/"true"/"yes": the request's blocks are not stored
TRUTHS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
UNION_MESSAGES = {"prompt": "must be a string, a list of token ids, or a list of strings or of token id lists",
                  "stop": "must be a string or a list of strings"}


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

    def no_store(request: Request, req: SamplingFields) -> bool:
        """"Do not store": the body's ``kvstore.store: false`` or the X-KVStore-No-Store header."""
        header = request.headers.get(NO_STORE_HEADER)
        if header is not None and header.strip().lower() not in TRUTHS:
            raise bad_request(f"the X-KVStore-No-Store header must be one of {sorted(TRUTHS)}, got {header[:40]!r}")
        by_header = header is not None and TRUTHS[header.strip().lower()]
        return by_header or (req.kvstore is not None and not req.kvstore.store)

    def sampling(req: SamplingFields, max_tokens: int | None, prompt_len: int, skip_store: bool) -> SamplingParams:
        if max_tokens is None:
            max_tokens = max(1, loop.llm.max_model_len - prompt_len)
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=float(req.temperature), top_p=float(req.top_p),
                                  top_k=req.top_k, seed=req.seed, n=req.n, ignore_eos=req.ignore_eos,
                                  skip_writing_prefix_cache=skip_store)
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    async def generate(request: Request, kind: str, req: SamplingFields, prompts: list[list[int]],
                       max_tokens: int | None, tenant: str) -> Response:
        skip_store = no_store(request, req)
        run = Run(state, kind, req, prompts, [sampling(req, max_tokens, len(ids), skip_store) for ids in prompts],
                  tenant)
        return run.stream() if req.stream else await run.whole(request)

    def check_model(req: SamplingFields) -> None:
        if req.model is not None and req.model != state.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {state.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def prompt_ids(prompt: str | list[int], param: str) -> list[int]:
        """The ids the engine would run for a prompt (text, or token ids); a 400 naming ``param``."""
        try:
            return loop.llm.prompt_token_ids(tok.encode(prompt) if isinstance(prompt, str) else prompt)
        except ValueError as exc:
            raise bad_request(str(exc), param=param) from None

    def chat_ids(req: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        assert req.messages is not None
        try:
            ids = tok.encode_chat([m.as_dict() for m in req.messages])
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None
        return prompt_ids(ids, "messages")

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
        return await generate(request, "chat", req, [chat_ids(req)], req.max_new_tokens, tenant)

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
        if req.messages is not None:  # checked as the completion paths check a prompt
            return JSONResponse({"tokens": chat_ids(req)})
        assert req.prompt is not None
        return JSONResponse({"tokens": prompt_ids(req.prompt, "prompt")})

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
