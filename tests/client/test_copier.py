"""The shared copy: every byte lands, however the chunks fall among the threads."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest
import torch

from kvstore.client import copier as copier_module
from kvstore.client.copier import CHUNK, MIN_BYTES, Copier

from factories import run_in_threads


def pieces(nbytes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return torch.zeros_like(src), src


def test_a_large_copy_of_several_pairs_lands_whole() -> None:
    c = Copier(2)
    try:
        # sizes that end mid-chunk, and one pair smaller than a chunk
        pairs = [pieces(MIN_BYTES + CHUNK // 3, 1), pieces(CHUNK // 2 + 7, 2), pieces(3 * CHUNK + 1, 3)]
        c.copy(pairs)
        for dst, src in pairs:
            assert torch.equal(dst, src)
    finally:
        c.close()


def test_typed_rows_are_copied_as_copy_would() -> None:
    c = Copier(2)
    try:
        src = torch.randn(64, 3, 16, 128).to(torch.bfloat16)  # 768 KiB
        big = torch.randn(40, 3, 16, 1024)  # 7.5 MiB of float32
        dst, big_dst = torch.empty_like(src), torch.empty_like(big)
        c.copy([(dst, src), (big_dst, big)])
        assert torch.equal(dst, src) and torch.equal(big_dst, big)
    finally:
        c.close()


def test_pairs_a_flat_copy_cannot_serve_go_to_torch() -> None:
    c = Copier(2)
    try:
        src = torch.randn(2048, 1024)
        strided_dst = torch.zeros(1024, 2048).t()  # same shape, not contiguous
        converted = torch.zeros(2048, 1024, dtype=torch.float64)
        flat_dst, flat_src = pieces(MIN_BYTES, 4)
        c.copy([(strided_dst, src), (converted, src), (flat_dst, flat_src)])
        assert torch.equal(strided_dst, src)
        assert torch.equal(converted, src.double())
        assert torch.equal(flat_dst, flat_src)
    finally:
        c.close()


def test_a_thread_held_up_takes_fewer_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The point of the copier: the caller's thread is slowed (as by a neighbour on its core),
    and the helper takes the chunks it cannot get to. An even split up front fails this."""
    caller = threading.get_ident()
    done_by: list[int] = []
    real_memmove = ctypes.memmove

    def memmove(dst: int, src: int, n: int) -> int:
        if threading.get_ident() == caller:
            time.sleep(0.02)  # the caller held up: the slowdown under test
        done_by.append(threading.get_ident())
        return real_memmove(dst, src, n)

    monkeypatch.setattr(ctypes, "memmove", memmove)
    c = Copier(2)
    try:
        dst, src = pieces(16 * CHUNK, 5)
        c.copy([(dst, src)])
        assert torch.equal(dst, src)
        assert len(done_by) == 16
        by_caller = done_by.count(caller)
        assert by_caller < 8 < len(done_by) - by_caller, by_caller
    finally:
        c.close()


def test_small_copies_and_one_thread_stay_in_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: set[int] = set()
    real_memmove = ctypes.memmove

    def memmove(dst: int, src: int, n: int) -> int:
        threads.add(threading.get_ident())
        return real_memmove(dst, src, n)

    monkeypatch.setattr(ctypes, "memmove", memmove)
    for c, nbytes in ((Copier(2), MIN_BYTES - 1), (Copier(1), 2 * MIN_BYTES)):
        dst, src = pieces(nbytes, 6)
        c.copy([(dst, src)])
        assert torch.equal(dst, src)
        c.close()
    assert threads == {threading.get_ident()}


def test_copies_from_several_threads_at_once_each_land() -> None:
    c = Copier(2)
    try:
        jobs = [[pieces(MIN_BYTES + 4096 * i, 10 + i)] for i in range(4)]
        run_in_threads(lambda i: c.copy(jobs[i]), len(jobs))
        for job in jobs:
            dst, src = job[0]
            assert torch.equal(dst, src)
    finally:
        c.close()


def test_a_closed_copier_starts_again_and_a_bad_count_is_refused() -> None:
    c = Copier(3)
    c.copy([pieces(MIN_BYTES, 7)])
    c.close()
    dst, src = pieces(MIN_BYTES, 8)
    c.copy([(dst, src)])  # helpers start again
    assert torch.equal(dst, src)
    c.close()
    c.close()  # twice is fine
    with pytest.raises(ValueError, match="one thread or more"):
        Copier(0)


def test_the_default_follows_torch_threads_within_the_cap() -> None:
    assert Copier().threads == min(torch.get_num_threads(), copier_module.MAX_THREADS)


def test_a_forked_child_copies_with_helpers_of_its_own() -> None:
    """The parent's helper threads do not exist in a forked child: the child starts its own
    instead of queueing chunks for threads that will never take them."""
    import multiprocessing

    c = Copier(2)
    c.copy([pieces(MIN_BYTES, 9)])  # the parent's helpers are up

    def child(conn: object) -> None:
        # numpy only: torch's OpenMP pool, started in the parent, is not usable after a fork
        src = np.random.default_rng(10).integers(0, 256, MIN_BYTES + 5, dtype=np.uint8)
        dst = np.zeros_like(src)
        c.copy([(torch.from_numpy(dst), torch.from_numpy(src))])
        conn.send(bool(np.array_equal(dst, src)))  # type: ignore[attr-defined]

    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=child, args=(child_end,))
    proc.start()
    try:
        assert parent_end.poll(30), "the child's copy never finished"
        assert parent_end.recv() is True
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        c.close()
    assert proc.exitcode == 0
