"""Run: one API request's engine requests, from submission to the response.

Each prompt becomes one engine request on the EngineLoop. Its outputs come back through an
asyncio queue (the loop thread calls ``call_soon_threadsafe``); each becomes deltas
(kvstore/services/engine_server/generation.py), streamed as SSE (``stream``) or gathered into one body
(``whole``). A client that goes away, or a prompt whose samples all hit stop strings, is
aborted in the engine at once, so its blocks are freed; so is each sample that hits one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvstore.engine.sampling import SamplingParams
from kvstore.engine.sequence import RequestOutput
from kvstore.services.engine_server.errors import APIError, bad_request
from kvstore.services.engine_server.generation import Generation
from kvstore.services.engine_server.loop import EngineStepError
from kvstore.services.engine_server.responses import DONE, Shapes, sse
from kvstore.services.engine_server.schema import SamplingFields
from kvstore.services.engine_server.state import ServerState

log = logging.getLogger("kvstore.services.engine_server")
DISCONNECT_POLL_S = 0.25


class Run:
    """Submits ``prompts`` (validated token ids, one ``SamplingParams`` each) for ``tenant``."""

    def __init__(self, state: ServerState, kind: str, req: SamplingFields, prompts: list[list[int]],
                 params: list[SamplingParams], tenant: str) -> None:
        self.state = state
        self.kind = kind
        self.include_usage = req.include_usage
        self.shapes = Shapes(kind, f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}",
                             int(time.time()), state.model_name, req.include_usage)
        aloop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self.gens: list[Generation] = []
        now = time.perf_counter()
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            gen = Generation("", ids, req.n, req.stop_strings, state.tokenizer, first_index=i * req.n, arrival_s=now)

            def sink(item: RequestOutput | BaseException, i: int = i) -> None:
                with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody is waiting
                    aloop.call_soon_threadsafe(self.queue.put_nowait, (i, item))

            gen.request_id = state.loop.submit(ids, p, tenant, sink)
            self.gens.append(gen)
        state.num_inflight += 1

    async def deltas(self) -> AsyncIterator[Any]:
        """The deltas of every generation as their outputs arrive, until all are done."""
        metrics, loop = self.state.metrics, self.state.loop
        while not all(g.done for g in self.gens):
            i, item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            gen = self.gens[i]
            if gen.done:
                continue
            for d in gen.update(item, time.perf_counter()):
                yield d
            for gap in gen.gaps:
                metrics.itl.observe(gap)
            gen.gaps.clear()
            if not gen.done:
                for index in gen.stopped:  # a sample hit a stop string: free it, its siblings go on
                    loop.abort_sample(gen.request_id, index)
            gen.stopped.clear()
            if gen.done:
                if not gen.closed:  # every sample hit a stop string: free the engine now
                    loop.abort(gen.request_id)
                    gen.closed = True
                if gen.ttft_s is not None:
                    metrics.ttft.observe(gen.ttft_s)
                metrics.generation_done(gen)

    def finish(self) -> None:
        """Abort what still runs in the engine (a client gone, an error) and count the run out."""
        for gen in self.gens:
            if not gen.closed:
                self.state.loop.abort(gen.request_id)
                gen.closed = True
        self.state.num_inflight -= 1

    def stream(self) -> StreamingResponse:
        return StreamingResponse(self._events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self) -> AsyncIterator[bytes]:
        status = 200
        try:
            for chunk in self.shapes.first_chunks(self.gens):
                yield chunk
            try:
                async for d in self.deltas():
                    for chunk in self.shapes.chunks(d):
                        yield chunk
            except EngineStepError as exc:  # logged by the loop
                status = 500
                yield sse(APIError(500, str(exc), "server_error").body())
            except ValueError as exc:
                status = 400
                yield sse(bad_request(str(exc)).body())
            except Exception as exc:  # the engine failed: the stream ends with the error
                log.exception("generation failed")
                status = 500
                yield sse(APIError(500, f"generation failed: {type(exc).__name__}", "server_error").body())
            else:
                if self.include_usage:
                    yield self.shapes.usage_chunk(self.gens)
            yield DONE
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            self.finish()
            self.state.metrics.request_done(self.kind, status)

    async def whole(self, request: Request) -> Response:
        """Gather every delta into one body; a watcher aborts the run if the client goes away."""
        async def consume() -> None:
            async for _ in self.deltas():
                pass

        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)

        consumer, watcher = asyncio.ensure_future(consume()), asyncio.ensure_future(watch())
        try:
            await asyncio.wait([consumer, watcher], return_when=asyncio.FIRST_COMPLETED)
            if not consumer.done():  # the client went away first
                consumer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await consumer
                return Response(status_code=499)
            consumer.result()
        except EngineStepError as exc:
            raise APIError(500, str(exc), "server_error") from None
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        finally:
            watcher.cancel()
            self.finish()
        return JSONResponse(self.shapes.body(self.gens))
