"""Shared by the KV-event tests: waiting on a subscriber, free TCP port pairs."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvstore.events import Subscriber
from kvstore.tools.bench import ports


def until(cond: Callable[[], bool], sub: Subscriber, timeout: float = 30.0) -> None:
    """Poll ``sub`` until ``cond()`` holds; fail with the subscriber's counters after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out; subscriber {sub.stats()}"
        sub.poll(0.05)


def free_port_pair() -> int:
    """A port p with p + 1 free too (the replay socket's default), not handed out before in this
    process. Drawn below Linux's ephemeral range (32768-60999), and below the route tests'
    range (20000-32000), so that no outgoing connection takes one before the publisher binds."""
    return ports.free_port_pair(12000, 20000)
