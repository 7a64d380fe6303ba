"""EngineLoop: one thread owns the LLMEngine and runs ``step()`` (continuous batching); HTTP
handlers talk to it only through thread-safe queues.

  handler --submit(ids, params, tenant, sink)--> queue --> loop: add_request
  handler --abort(request_id)-----------------> queue --> loop: LLMEngine.abort (frees blocks)
  handler --abort_sample(request_id, index)----> queue --> loop: LLMEngine.abort_sample
  loop: step() -> each RequestOutput -> its request's sink (called on the loop thread)

A step that raises leaves the engine's state suspect: every request then running is aborted
and its sink gets an ``EngineStepError`` (a server error, never the client's fault), and the
loop keeps serving. Whatever a request can get wrong is refused before it runs (add_request).

After every step the loop publishes a ``Load`` snapshot (a fresh object: readers on other
threads never see one half-written), which ``/v1/kvstore/load`` and ``/metrics`` read.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.engine.llm import LLMEngine
from kvstore.engine.sampling import SamplingParams
from kvstore.engine.sequence import RequestOutput

log = logging.getLogger("kvstore.services.engine_server")
Sink = Callable[[RequestOutput | BaseException], None]
IDLE_WAIT_S = 0.5


class EngineStepError(RuntimeError):
    """A step of the engine failed; the requests it ran were aborted (the cause is chained)."""


@dataclass(frozen=True)
class Load:
    """The engine's queue and pool at the end of a step (docs/serving.md, /v1/kvstore/load)."""

    running: int = 0
    waiting: int = 0
    loading: int = 0
    queued_prefill_tokens: int = 0
    running_decode_seqs: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    fetched_blocks: int = 0
    failed_fetch_blocks: int = 0
    preemptions: int = 0

    def public(self) -> dict[str, Any]:
        return {"running": self.running, "waiting": self.waiting, "loading": self.loading,
                "queued_prefill_tokens": self.queued_prefill_tokens, "running_decode_seqs": self.running_decode_seqs,
                "kv_usage": self.kv_usage, "num_free_blocks": self.num_free_blocks}


class EngineLoop:
    """Runs an LLMEngine on its own thread. ``submit``/``abort``/``load`` are safe from any thread."""

    def __init__(self, llm: LLMEngine) -> None:
        self.llm = llm
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, Sink] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvstore-engine-loop", daemon=True)
        self.load = self._snapshot()
        self.num_steps = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, token_ids: list[int], params: SamplingParams, tenant: str, sink: Sink) -> str:
        """Queue a validated prompt; its outputs (or the error add_request raised) go to ``sink``."""
        request_id = uuid.uuid4().hex
        self._inbox.put(("add", (request_id, token_ids, params, tenant, sink)))
        self._wake.set()
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request (a client went away, or every sample hit a stop string)."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def abort_sample(self, request_id: str, index: int) -> None:
        """Stop one sample of a request (it hit a stop string; its siblings go on)."""
        self._inbox.put(("abort_sample", (request_id, index)))
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, stop the thread, close the engine (write-back to the store)."""
        self._inbox.put(("stop", None))
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("the engine loop did not stop within %.0f s", timeout)
            return
        self.llm.close()

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        while True:
            if not self.llm.has_unfinished_requests():
                self._wake.wait(IDLE_WAIT_S)
            self._wake.clear()
            if not self._drain_inbox():
                break
            if self.llm.has_unfinished_requests():
                self._step()
            self.load = self._snapshot()
        for request_id, sink in list(self._sinks.items()):
            self.llm.abort(request_id)
            sink(RuntimeError("the server stopped before the request finished"))
        self._sinks.clear()

    def _drain_inbox(self) -> bool:
        """Apply queued submissions and aborts; False once a stop was asked for."""
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if kind == "stop":
                return False
            if kind == "abort":
                if self._sinks.pop(item, None) is not None:
                    self.llm.abort(item)
                continue
            if kind == "abort_sample":
                if item[0] in self._sinks:
                    self.llm.abort_sample(*item)
                continue
            request_id, token_ids, params, tenant, sink = item
            try:
                self.llm.add_request(token_ids, params, tenant, request_id=request_id)
            except ValueError as exc:  # the request's fault: its client gets a 400
                sink(exc)
                continue
            except Exception as exc:  # not the request's fault: fail it alone, keep the loop alive
                log.exception("add_request failed")
                sink(exc)
                continue
            self._sinks[request_id] = sink

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as exc:  # the engine's state is suspect: fail what runs, keep serving
            log.exception("engine step failed; aborting %d requests", len(self._sinks))
            error = EngineStepError(f"the engine failed ({type(exc).__name__}); the request was aborted")
            error.__cause__ = exc
            for request_id, sink in list(self._sinks.items()):
                try:
                    self.llm.abort(request_id)
                except Exception:
                    log.exception("abort after a failed step")
                sink(error)
            self._sinks.clear()
            return
        self.num_steps += 1
        for out in outputs:
            target = self._sinks.get(out.request_id)
            if target is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            target(out)

    def _snapshot(self) -> Load:
        sched = self.llm.scheduler
        blocks = self.llm.block_manager
        num_blocks = blocks.pool.num_blocks
        free = blocks.num_available  # free, or cached and unreferenced: what requests can take
        prefill = sum(s.num_tokens - s.num_cached_tokens for s in sched.waiting)
        prefill += sum(s.num_tokens - s.num_cached_tokens for s in sched.running if not s.is_decoding)
        fetcher = self.llm.fetcher
        return Load(running=len(sched.running), waiting=len(sched.waiting) + self._inbox.qsize(),
                    loading=len(sched.loading), queued_prefill_tokens=prefill,
                    running_decode_seqs=sum(1 for s in sched.running if s.is_decoding),
                    kv_usage=(num_blocks - free) / num_blocks, num_free_blocks=blocks.pool.num_free,
                    num_blocks=num_blocks,
                    fetched_blocks=fetcher.num_fetched_blocks if fetcher else 0,
                    failed_fetch_blocks=fetcher.num_failed_blocks if fetcher else 0,
                    preemptions=sched.num_preemptions)


def wait_idle(loop: EngineLoop, deadline: float) -> bool:
    """Wait until no request runs or queues (True), or the monotonic ``deadline`` passes (False)."""
    while time.monotonic() < deadline:
        load = loop.load
        if not (load.running or load.waiting or load.loading):
            return True
        time.sleep(0.02)
    return False
