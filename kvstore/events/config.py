"""EventsConfig: every knob of a KV-event publisher, frozen and validated."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvstore.errors import ConfigError

SCHEMES = ("tcp://", "ipc://", "inproc://")
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"


def _tcp_parts(endpoint: str, name: str = "endpoint") -> tuple[str, str]:
    """``("tcp://HOST", PORT)`` of a tcp endpoint, PORT a port number or ``*``."""
    match = re.fullmatch(r"(tcp://.+):(\d+|\*)", endpoint)
    if match is None:
        raise ConfigError(f"{name}: a tcp endpoint is tcp://HOST:PORT (PORT a number or *), got {endpoint!r}")
    port = match.group(2)
    if port != "*" and not 0 < int(port) < 65536:
        raise ConfigError(f"{name}: port {port} of {endpoint!r} is not in 1-65535 (* takes a free one)")
    return match.group(1), port


def replay_endpoint_for(endpoint: str) -> str:
    """The replay socket's default address: the next TCP port (``*`` stays ``*``), or the
    same ipc/inproc name with ``-replay`` appended."""
    if endpoint.startswith("tcp://"):
        host, port = _tcp_parts(endpoint)
        if port == "65535":
            raise ConfigError(f"the replay endpoint of {endpoint!r} would take the next port, and there is "
                              "none: choose a lower port or set replay_endpoint")
        return f"{host}:{port if port == '*' else int(port) + 1}"
    return endpoint + "-replay"


@dataclass(frozen=True)
class EventsConfig:
    """Configuration of an ``EventPublisher``.

    Attributes:
        endpoint: the PUB socket's bind address, ``tcp://HOST:PORT`` (``PORT`` may be ``*``
            for a free port), ``ipc://PATH`` or ``inproc://NAME``. The stream is not
            authenticated and carries token ids: keep it on loopback or a private network.
        replay_endpoint: the ROUTER socket for replay and snapshot requests; None derives it
            (``replay_endpoint_for``: port + 1), "" disables replay and snapshots.
        topic: the first frame of every message (vLLM's ``topic``, default empty).
        buffer_batches: batches kept for replay (vLLM's ``buffer_steps``).
        buffer_bytes: most payload bytes kept for replay (the oldest batches go first).
        queue_size: items waiting for the publisher thread (one per ``stored``/``removed``
            call, of any number of blocks); a full queue drops and counts.
        heartbeat_s: an empty batch is sent after this long without one.
        max_batch_events: most queued items packed into one batch.
        data_parallel_rank: the batch's third element.
        hwm: the PUB socket's send high-water mark (messages).
    """

    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_batches: int = 10_000
    buffer_bytes: int = 64 << 20
    queue_size: int = 100_000
    heartbeat_s: float = 1.0
    max_batch_events: int = 1024
    data_parallel_rank: int = 0
    hwm: int = 100_000

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value and (not isinstance(value, str) or not value.startswith(SCHEMES)):
                raise ConfigError(f"{name} must start with one of {list(SCHEMES)}, got {value!r}")
            if value and value.startswith("tcp://"):
                _tcp_parts(value, name)
        if not self.endpoint:
            raise ConfigError("endpoint is required")
        if self.replay_endpoint is None:
            object.__setattr__(self, "replay_endpoint", replay_endpoint_for(self.endpoint))
        if not isinstance(self.topic, str):
            raise ConfigError(f"topic must be a str, got {type(self.topic).__name__}")
        for name in ("buffer_batches", "buffer_bytes", "queue_size", "max_batch_events", "hwm"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.heartbeat_s, int | float) or not 0 < self.heartbeat_s <= 3600:
            raise ConfigError(f"heartbeat_s must be in (0, 3600], got {self.heartbeat_s!r}")
        if not isinstance(self.data_parallel_rank, int) or self.data_parallel_rank < 0:
            raise ConfigError(f"data_parallel_rank must be an int >= 0, got {self.data_parallel_rank!r}")
