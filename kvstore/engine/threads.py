"""A worker thread whose torch ops run on one thread: where the engine runs its steps of one
sequence and a few rows (kvstore/engine/runner.py, ``ONE_THREAD_ROWS``) when its weights are
not prepacked. Prepacked (the default on the CPU), oneDNN's products use a second thread well
even at one row, and every step runs on the caller (docs/engine.md, Threads).

A step of one row (a decode step of one sequence, the last token of a prompt found whole) is
a chain of small ops, ~40 a layer besides the products, each too small to gain from a second
thread and each paying the OpenMP team's fork and join; so are steps of up to 16 rows of one
sequence (a prompt's last partial block over its cached prefix). On the 2-core EPYC, the bench model's
one-row step over 2,047 cached tokens took 21.0-21.6 ms here against 23.0-23.3 ms on the
caller's two threads (the best of 15 hits alternating between the two in one process; two
processes), a decode step of one sequence 13.3-13.5 ms against 15.5 (docs/benchmarks.md, engine).

Why a thread of its own: torch's thread count is kept per OS thread, but
``torch.set_num_threads`` also sets the count a thread starts with, read at its first torch
op. Lowering it around each step would have let any thread started meanwhile (a store's
transfer thread, one of the application's) keep one thread for good, and such steps are
most of an engine's time when it serves one sequence. Here the count is lowered once, on
the worker, and the caller's is set back at once, so every other thread keeps its count.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


class OneThreadWorker:
    """Runs calls on its own thread, whose torch ops use one thread; the caller waits."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-one-thread")
        threads = torch.get_num_threads()

        def start() -> None:
            torch.get_num_threads()  # this thread's first torch call: its count is taken now
            torch.set_num_threads(1)

        try:
            self._executor.submit(start).result()
        finally:
            torch.set_num_threads(threads)  # what threads started from now on begin with

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the worker; returns its result or raises its exception."""
        return self._executor.submit(fn, *args).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
