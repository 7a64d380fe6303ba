"""Free loopback ports for processes that bind a port and the next one (KV events + replay)."""

from __future__ import annotations

import random
import socket
import threading

_TAKEN: set[int] = set()  # handed out by this process: never twice
_LOCK = threading.Lock()


def free_port_pair(low: int = 20000, high: int = 32000) -> int:
    """An even port ``p`` in ``[low, high)`` with ``p`` and ``p + 1`` free on 127.0.0.1, not
    handed out before in this process. The default range lies below Linux's ephemeral range
    (32768-60999), so no outgoing connection takes one between this check and the bind.

    Raises:
        RuntimeError: no such pair found in 1,000 draws.
    """
    with _LOCK:
        for _ in range(1000):
            port = random.randrange(low + low % 2, high - 1, 2)
            if port in _TAKEN:
                continue
            try:
                for candidate in (port, port + 1):
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            _TAKEN.add(port)
            return port
    raise RuntimeError(f"no two adjacent free ports in {low}-{high}")
