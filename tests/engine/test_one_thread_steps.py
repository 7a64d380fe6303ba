"""On the CPU with plain (MKL) products, steps of one sequence and at most ONE_THREAD_ROWS rows
run on the engine's one-thread worker (kvstore/engine/threads.py): its torch ops use one thread,
every other step runs on the caller with the caller's count, and no other thread's count
changes, also for threads started after the engine. With prepacked weights (oneDNN's products
use both threads well at one row) every step runs on the caller."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.engine.runner import ONE_THREAD_ROWS
from kvstore.engine.threads import OneThreadWorker
from tests.engine.conftest import GREEDY, hf_greedy_check, make_engine


@pytest.fixture
def two_threads() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _count_in_new_thread() -> int:
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: (torch.ones(1 << 16).add_(1), torch.get_num_threads())[1]).result()


def test_steps_of_one_short_sequence_run_on_the_worker_with_one_thread(hf_llama: tuple[Any, Path],
                                                                     two_threads: None) -> None:
    model, path = hf_llama
    llm = make_engine(path, prepack_weights=False)
    assert torch.get_num_threads() == 2 and _count_in_new_thread() == 2  # the engine's start changed neither
    seen: list[tuple[int, str, int]] = []  # (rows, thread, torch threads) per forward
    forward = llm.model.forward

    def spy(input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append((input_ids.shape[0], threading.current_thread().name, torch.get_num_threads()))
        return forward(input_ids, *args)

    def threads_of_steps() -> list[tuple[int, bool, int]]:
        steps = [(rows, name.startswith("engine-one-thread"), t) for rows, name, t in seen]
        assert all(name.startswith("engine-one-thread") or name == threading.current_thread().name
                   for _, name, _ in seen)
        seen.clear()
        return steps

    short, long = list(range(10, 10 + ONE_THREAD_ROWS)), list(range(50, 51 + ONE_THREAD_ROWS))  # no shared prefix
    llm.model.forward = spy  # type: ignore[method-assign]
    try:
        # one sequence: its prompt, then 5 one-row decode steps
        one = llm.generate([short], GREEDY)[0]
        assert threads_of_steps() == [(ONE_THREAD_ROWS, True, 1)] + [(1, True, 1)] * 5
        # a prompt one row too long for the worker; its decode steps are one row again
        longer = llm.generate([long], GREEDY)[0]
        assert threads_of_steps() == [(ONE_THREAD_ROWS + 1, False, 2)] + [(1, True, 1)] * 5
        # two sequences at once: every step on the caller, with its two threads
        two = llm.generate([[9, 8, 7], [6, 5]], GREEDY)
        assert threads_of_steps() == [(5, False, 2)] + [(2, False, 2)] * 5
    finally:
        llm.close()
    # the tokens are still transformers' (the worker runs the same forward)
    hf_greedy_check(model, short, one.token_ids)
    hf_greedy_check(model, long, longer.token_ids)
    for prompt, out in zip([[9, 8, 7], [6, 5]], two, strict=True):
        hf_greedy_check(model, prompt, out.token_ids)
    assert torch.get_num_threads() == 2 and _count_in_new_thread() == 2
    assert not any(t.name.startswith("engine-one-thread") for t in threading.enumerate())  # closed


def test_prepacked_weights_run_every_step_on_the_caller(hf_llama: tuple[Any, Path], two_threads: None) -> None:
    model, path = hf_llama
    llm = make_engine(path)  # prepack_weights=True, the default
    assert llm.model.prepacked
    seen: list[tuple[int, str, int]] = []
    forward = llm.model.forward

    def spy(input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append((input_ids.shape[0], threading.current_thread().name, torch.get_num_threads()))
        return forward(input_ids, *args)

    llm.model.forward = spy  # type: ignore[method-assign]
    prompt = list(range(10, 10 + ONE_THREAD_ROWS))
    try:
        out = llm.generate([prompt], GREEDY)[0]
    finally:
        llm.close()
    me = threading.current_thread().name
    assert seen == [(ONE_THREAD_ROWS, me, 2)] + [(1, me, 2)] * 5
    hf_greedy_check(model, prompt, out.token_ids)
    assert not any(t.name.startswith("engine-one-thread") for t in threading.enumerate())


def test_the_worker_returns_results_and_raises_errors(two_threads: None) -> None:
    worker = OneThreadWorker()
    try:
        assert worker.call(torch.get_num_threads) == 1
        assert worker.call(lambda a, b: a + b, 2, 3) == 5

        def boom() -> None:
            raise ValueError("bad step")

        with pytest.raises(ValueError, match="bad step"):
            worker.call(boom)
        assert worker.call(torch.get_num_threads) == 1  # still serving after an error
    finally:
        worker.close()
    assert torch.get_num_threads() == 2 and _count_in_new_thread() == 2


def test_a_single_threaded_process_gets_no_worker(llama_dir: Path) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = make_engine(llama_dir)
        try:
            seen: list[str] = []
            forward = llm.model.forward

            def spy(input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
                seen.append(threading.current_thread().name)
                return forward(input_ids, *args)

            llm.model.forward = spy  # type: ignore[method-assign]
            llm.generate([[5]], GREEDY)
        finally:
            llm.close()
        assert set(seen) == {threading.current_thread().name}
    finally:
        torch.set_num_threads(before)
