"""BufferPool: the smallest kept buffer that fits, by position (tensors compare element-wise),
within a byte budget, across threads."""

from __future__ import annotations

import threading

import torch

from kvstore.store.buffer_pool import BufferPool


def rows(n: int) -> torch.Tensor:
    return torch.zeros((n, 16), dtype=torch.uint8)


def test_the_smallest_kept_buffer_that_fits_is_taken_wherever_it_sits() -> None:
    made: list[int] = []
    pool = BufferPool(lambda n: made.append(n) or rows(n), keep_bytes=1 << 20)
    small, large, mid = pool.take(2), pool.take(9), pool.take(5)
    assert made == [2, 9, 5]
    for buf in (large, small, mid):
        pool.give(buf)
    assert len(pool) == 3
    assert pool.take(6) is large  # the only one that fits, last but one in the pool
    assert pool.take(3) is mid  # smaller than large would have been, and not first
    assert pool.take(1) is small
    assert pool.take(4).shape[0] == 4 and made == [2, 9, 5, 4], "none kept: a new one of exactly 4 rows"


def test_buffers_beyond_the_byte_budget_are_not_kept() -> None:
    pool = BufferPool(rows, keep_bytes=3 * 16 + 5 * 16)
    a, b, c = pool.take(3), pool.take(5), pool.take(1)
    pool.give(a)
    pool.give(b)
    pool.give(c)  # 16 bytes over the budget: dropped
    assert len(pool) == 2
    assert pool.take(1) is a and pool.take(1) is b and len(pool) == 0


def test_taken_on_one_thread_given_back_on_another() -> None:
    pool = BufferPool(rows, keep_bytes=1 << 20)
    taken = [pool.take(4) for _ in range(8)]
    threads = [threading.Thread(target=pool.give, args=(buf,)) for buf in taken]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(pool) == 8
    again = {id(pool.take(4)) for _ in range(8)}
    assert again == {id(buf) for buf in taken} and len(pool) == 0
