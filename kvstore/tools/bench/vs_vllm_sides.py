"""The two sides of ``kvstore bench vs-vllm`` as one loop drives them, and how each is timed.

``Side`` is an engine as the decode loop sees it (queue prompts, step, each request's token
count): ``Ours`` is the kvstore engine, ``Theirs`` a vLLM ``LLM`` through its engine's own step
loop. ``decode_rate`` times decode from the first token to the last, ``ttft`` the wall time of
``generate(max_tokens=1)``, and ``profiled`` / ``profile_decode`` say where the time goes
(torch profiler, all threads). vLLM is imported only inside ``Theirs``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvstore.engine.llm import LLMEngine
from kvstore.engine.sampling import SamplingParams


class Side(Protocol):
    """One engine as the decode loop drives it: queue prompts, step, see each request's tokens."""

    def add(self, prompts: list[list[int]], max_tokens: int) -> None: ...

    def step(self) -> dict[str, int]:
        """One engine step; the number of tokens so far of each request that progressed."""
        ...

    def busy(self) -> bool: ...


class Ours:
    """The kvstore engine as a ``Side``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def add(self, prompts: list[list[int]], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for p in prompts:
            self.engine.add_request(p, params)

    def step(self) -> dict[str, int]:
        return {out.request_id: len(out.token_ids) for out in self.engine.step()}

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()


class Theirs:
    """A vLLM ``LLM`` as a ``Side``, through its engine's own step loop."""

    _ids = itertools.count()

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def add(self, prompts: list[list[int]], max_tokens: int) -> None:
        from vllm import SamplingParams as VllmParams

        params = VllmParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for p in prompts:
            self.llm.llm_engine.add_request(f"vs-{next(self._ids)}", {"prompt_token_ids": p}, params)

    def step(self) -> dict[str, int]:
        return {out.request_id: len(out.outputs[0].token_ids) for out in self.llm.llm_engine.step() if out.outputs}

    def busy(self) -> bool:
        return bool(self.llm.llm_engine.has_unfinished_requests())


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    """Wall time of ``generate(max_tokens=1)``, as ``vllm_ttft`` times vLLM's."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    engine.generate([prompt], params)
    return time.perf_counter() - started


def _until_first_tokens(side: Side, num_prompts: int) -> dict[str, int]:
    """Step until each of the ``num_prompts`` requests just added has a token; their token counts."""
    seen: dict[str, int] = {}
    while len(seen) < num_prompts or min(seen.values()) < 1:
        seen.update(side.step())
    return seen


def decode_rate(side: Side, prompts: list[list[int]], new: int) -> float:
    """Tokens/s from the step that gave the first token to the step that gave the last, counting
    the tokens of the steps after the first (every prompt prefills in that first step)."""
    side.add(prompts, new + 1)
    seen = _until_first_tokens(side, len(prompts))
    first = last = time.perf_counter()
    counted = 0
    while side.busy():
        for request_id, num_tokens in side.step().items():
            counted += num_tokens - seen.get(request_id, 0)
            seen[request_id] = num_tokens
            last = time.perf_counter()
    return counted / (last - first)


def profiled(fn: Callable[[], object], per: int = 1) -> tuple[float, dict[str, float]]:
    """``fn``'s wall time under the torch profiler and each op's self CPU time, in ms per ``per``."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    # all threads: the engine runs a step of one sequence on its one-thread worker
    with profile(activities=[ProfilerActivity.CPU],
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        started = time.perf_counter()
        fn()
        wall = time.perf_counter() - started
    return wall / per * 1e3, {e.key: e.self_cpu_time_total / 1e3 / per for e in prof.key_averages()}


def profile_decode(side: Side, prompts: list[list[int]], steps: int) -> tuple[float, dict[str, float]]:
    """``profiled`` of ``steps`` decode steps of ``prompts``, after their first decode step."""
    side.add(prompts, steps + 3)
    _until_first_tokens(side, len(prompts))
    side.step()
    result = profiled(lambda: [side.step() for _ in range(steps)], steps)
    while side.busy():
        side.step()
    return result
