"""Shared by the KV-event tests: waiting on a subscriber, free TCP port pairs."""

from __future__ import annotations

from collections.abc import Callable

from kvstore.events import Subscriber
from kvstore.tools.bench import ports

from waiting import wait_until


def until(cond: Callable[[], bool], sub: Subscriber, timeout: float = 30.0,
          what: str = "the condition") -> None:
    """Drive ``sub`` (each ``poll`` waits on its socket up to 50 ms) until ``cond()`` holds; fail
    with the subscriber's counters after ``timeout``."""

    def check() -> bool:
        if cond():
            return True
        sub.poll(0.05)
        return False

    wait_until(check, timeout, lambda: f"{what}; subscriber {sub.stats()}", poll_s=0)


def free_port_pair() -> int:
    """A port p with p + 1 free too (the replay socket's default), not handed out before in this
    process. Drawn below Linux's ephemeral range (32768-60999), and below the route tests'
    range (20000-32000), so that no outgoing connection takes one before the publisher binds."""
    return ports.free_port_pair(12000, 20000)
