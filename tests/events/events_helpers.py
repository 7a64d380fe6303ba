"""Shared by the KV-event tests: waiting on a subscriber, free TCP port pairs."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from kvstore.events import Subscriber


def until(cond: Callable[[], bool], sub: Subscriber, timeout: float = 30.0) -> None:
    """Poll ``sub`` until ``cond()`` holds; fail with the subscriber's counters after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out; subscriber {sub.stats()}"
        sub.poll(0.05)


def free_port_pair() -> int:
    """A port p with p + 1 free too (the replay socket's default)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two adjacent free ports")
