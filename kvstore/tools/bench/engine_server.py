"""The served rows of ``kvstore bench engine``: what HTTP adds to an engine call.

- TTFT of a prompt whose prefix (``--prompt-tokens``, 2,048) is cached on the device, over
  HTTP (a streamed completion to a ``kvstore engine`` process, until its first SSE event) vs
  the same call in process (``LLMEngine.generate``, max_tokens 1, on a worker thread as the
  server's engine loop runs it), same model, same pool; interleaved rounds, best of each.
  Target: HTTP adds under 5 ms.
- Request throughput: 32 short requests sent at once over HTTP (continuous batching) vs one
  at a time over HTTP, and vs the same 32 prompts in one in-process ``generate`` (the batching
  ceiling: HTTP should keep nearly all of it).
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvstore.engine.sampling import SamplingParams
from kvstore.tools.bench.harness import ratio_text, start_service
from kvstore.tools.bench.models import BenchModel

NUM_CONCURRENT = 32
SHORT_PROMPT, SHORT_TOKENS = 8, 16


class _Server:
    """A ``kvstore engine`` subprocess on a free loopback port."""

    def __init__(self, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "kvstore.cli", "engine", "--port", "0", *args]
        self.proc, line = start_service(cmd, "kvstore engine")
        match = re.search(r"(http://\S+) ", line)
        assert match, line
        self.url = match.group(1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def _first_event_s(client: Any, url: str, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    seconds = 0.0
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        for line in r.iter_lines():  # read to the end: the connection is reused
            if not seconds and line.startswith("data: {"):
                seconds = time.perf_counter() - t0
    assert seconds, "no SSE event came back"
    return seconds


def bench_served(args: Any, engine: Callable[..., Any], model: BenchModel, block: int,
                 pool_bytes: int) -> dict[str, Any]:
    """Run both measurements; ``engine(args, **kw)`` builds the in-process engine (kvstore/tools/bench/engine.py)."""
    import httpx

    vocab = model.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(5)).tolist()
    server = _Server([*model.server_args(), "--block-size", str(block),
                      "--kv-cache", str(pool_bytes), "--host-mem", "0", "--max-num-batched-tokens", "4096",
                      "--device", args.device])
    llm = engine(args, host_bytes=0)
    r: dict[str, Any] = {"prompt_tokens": args.prompt_tokens}
    worker = ThreadPoolExecutor(1)
    try:
        with httpx.Client(timeout=300) as client:
            greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

            def call() -> float:
                t0 = time.perf_counter()
                llm.generate([prompt], greedy)
                return time.perf_counter() - t0

            def in_process() -> float:  # on a worker thread, as the server's engine loop runs
                return worker.submit(call).result()

            in_process(), _first_event_s(client, server.url, prompt)  # compute once: now cached on both
            best = {"http": float("inf"), "inproc": float("inf")}
            for _ in range(10 * args.repeat):  # tens of milliseconds each: many interleaved rounds
                best["inproc"] = min(best["inproc"], in_process())
                best["http"] = min(best["http"], _first_event_s(client, server.url, prompt))
            r["ttft_http_s"], r["ttft_inproc_s"] = best["http"], best["inproc"]

        gen = torch.Generator().manual_seed(6)
        shorts = [torch.randint(0, vocab, (SHORT_PROMPT,), generator=gen).tolist() for _ in range(NUM_CONCURRENT)]

        def body(p: list[int]) -> dict[str, Any]:
            return {"prompt": p, "max_tokens": SHORT_TOKENS, "temperature": 0, "ignore_eos": True}

        def sequential() -> float:
            with httpx.Client(timeout=300) as client:
                t0 = time.perf_counter()
                for p in shorts:
                    reply = client.post(f"{server.url}/v1/completions", json=body(p))
                    assert reply.status_code == 200, reply.text
                return time.perf_counter() - t0

        async def at_once() -> float:
            limits = httpx.Limits(max_connections=NUM_CONCURRENT)
            async with httpx.AsyncClient(timeout=300, limits=limits) as client:
                t0 = time.perf_counter()
                replies = await asyncio.gather(*(client.post(f"{server.url}/v1/completions", json=body(p))
                                                 for p in shorts))
                seconds = time.perf_counter() - t0
            assert all(reply.status_code == 200 for reply in replies)
            return seconds

        def concurrent() -> float:
            return asyncio.run(at_once())

        batch_params = SamplingParams(max_tokens=SHORT_TOKENS, temperature=0.0, ignore_eos=True)

        def batched_in_process() -> float:  # the same 32 prompts in one generate call: the batching ceiling
            def call() -> float:
                t0 = time.perf_counter()
                llm.generate(shorts, batch_params)
                return time.perf_counter() - t0
            return worker.submit(call).result()

        concurrent(), batched_in_process()  # warm-up
        best = {"seq": float("inf"), "conc": float("inf"), "batch": float("inf")}
        for _ in range(args.repeat):
            best["seq"] = min(best["seq"], sequential())
            best["conc"] = min(best["conc"], concurrent())
            best["batch"] = min(best["batch"], batched_in_process())
        r["seq_rps"] = NUM_CONCURRENT / best["seq"]
        r["conc_rps"] = NUM_CONCURRENT / best["conc"]
        r["batch_rps"] = NUM_CONCURRENT / best["batch"]
    finally:
        worker.shutdown()
        llm.close()
        server.stop()
    return r


def rows(s: dict[str, Any]) -> list[tuple[str, str, str, str, str, bool]]:
    """The served rows of the engine table: (measurement, ours, baseline, ratio, target, met)."""
    added_ms = (s["ttft_http_s"] - s["ttft_inproc_s"]) * 1e3
    x, kept = s["conc_rps"] / s["seq_rps"], s["conc_rps"] / s["batch_rps"]
    short = f"{NUM_CONCURRENT} short requests ({SHORT_PROMPT}-token prompts, {SHORT_TOKENS} tokens)"
    return [
        (f"served: TTFT over HTTP, {s['prompt_tokens']:,}-token prefix on device", f"{s['ttft_http_s'] * 1e3:.1f} ms",
         f"in-process call {s['ttft_inproc_s'] * 1e3:.1f} ms", f"{added_ms:+.1f} ms", "< +5 ms", added_ms < 5),
        (f"served: {short} at once", f"{s['conc_rps']:.1f} req/s",
         f"one at a time {s['seq_rps']:.1f} req/s", f"{x:.1f}x", ">= 3x", x >= 3),
        (f"served: {short} at once", f"{s['conc_rps']:.1f} req/s",
         f"in-process generate of all {NUM_CONCURRENT} {s['batch_rps']:.1f} req/s", f"{ratio_text(kept, 0.9)}x", ">= 0.9x",
         kept >= 0.9),
    ]
