"""What the long-running servers share (kvstore.services.common.http): the listening socket and the
heap freeze once started."""

from __future__ import annotations

import gc
import socket
import weakref
from collections.abc import Iterator

import pytest

from kvstore.errors import ConfigError
from kvstore.services.common.http import bind, freeze_start_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the suite runs with the collector as it found it


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_the_heap_built_to_start_is_frozen_and_later_cycles_are_still_collected(unfrozen: None) -> None:
    started = Node()
    freeze_start_heap()
    assert gc.get_freeze_count() > 1000  # the modules, torch, this test session...
    assert not any(obj is started for gen in range(3) for obj in gc.get_objects(generation=gen))  # in no generation
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle made while serving
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None  # the collector still frees what the server makes and drops


def test_bind_names_the_address_it_could_not_take() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind("127.0.0.1", port)
    finally:
        taken.close()
    sock = bind("127.0.0.1", 0)
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    sock.close()
