"""ConnectorSettings: the connector's ``kv_connector_extra_config``, validated and frozen.

Imports nothing from vLLM, so the settings can be checked (and documented) without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvstore.client.client import parse_address
from kvstore.config import WRITE_POLICIES
from kvstore.errors import ConfigError
from kvstore.keys import HASHES
from kvstore.services.daemon.config import parse_size

TIERS = ("host", "disk", "remote")
_TEXT = ("disk_path", "remote_url", "model_id")  # optional text settings: unset or a non-empty str


@dataclass(frozen=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` may hold (every key optional).

    Attributes:
        store: ``unix:///path/kvstore.sock`` or ``tcp://HOST:PORT`` of a kvstore daemon
            (several vLLM processes share it), or "embedded" (default): a TieredStore in
            this process, which needs the scheduler and the worker in one process.
        token: the daemon token (default: KVSTORE_TOKEN); it names the daemon-side tenant.
        host_bytes, disk_path, disk_bytes, write_policy: the embedded store's tiers
            (sizes as ints or text like ``"2GiB"``); ignored for a daemon.
        remote_url: the embedded store's remote tier (``redis+cluster://h:p,...`` or
            ``redis://h:p``, see docs/remote.md), shared with other nodes; ignored for a daemon
            (``kvstore serve --remote`` gives a daemon one).
        model_id: the namespace's model identity, when the checkpoint path is not stable
            across machines (default: derived from vLLM's model config, see identity.py).
        hash_algo: the key hash ("sha256"; "xxh3_128" only where one tenant sends prompts).
        async_tiers: loads touching one of these tiers ("host", "disk", "remote") run
            asynchronously (the request waits while others run); loads from the other tiers
            run inside the step that needs them.
        async_when_idle: load asynchronously even when no other request is in flight
            (default: such a load runs inside the step, as nothing else would wait for it,
            and an asynchronous one costs vLLM's loop extra steps to notice).
        retry_s: the longest wait between reconnection attempts after a store failure (they
            run on a background thread, the first at once, then after waits doubling from
            0.1 s, backend.RETRY_FIRST_S, up to retry_s).
        timeout_s: seconds one daemon request of the worker (a fetch, a put) may take before
            the store counts as down.
        lookup_timeout_s: the same for the scheduler's lookups, which run on vLLM's
            scheduling thread: a daemon that stops answering stalls the engine this long, once.
    """

    store: str = "embedded"
    token: str | None = None
    host_bytes: int = 1 << 30
    disk_path: str | None = None
    disk_bytes: int = 0
    write_policy: str = "write_back"
    remote_url: str | None = None
    model_id: str | None = None
    hash_algo: str = "sha256"
    async_tiers: tuple[str, ...] = ("disk", "remote")
    async_when_idle: bool = False
    retry_s: float = 10.0
    timeout_s: float = 10.0
    lookup_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.store, str):
            raise ConfigError(f"store must be 'embedded', unix:///path or tcp://host:port, got {self.store!r}")
        if self.store != "embedded":
            try:
                parse_address(self.store)
            except ValueError:
                raise ConfigError(f"store must be 'embedded', unix:///path or tcp://host:port, "
                                  f"got {self.store!r}") from None
        if self.token is not None and not isinstance(self.token, str):
            raise ConfigError(f"token must be a string, got a {type(self.token).__name__}")  # never the value
        for name in _TEXT:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{name} must be a non-empty string or unset, got {value!r}")
        for name in ("host_bytes", "disk_bytes"):
            try:
                object.__setattr__(self, name, parse_size(getattr(self, name)))
            except ConfigError as exc:
                raise ConfigError(f"{name}: {exc}") from None
        if self.disk_path is not None and self.disk_bytes <= 0:
            raise ConfigError(f"disk_path={self.disk_path!r} needs disk_bytes > 0")
        if not isinstance(self.write_policy, str) or self.write_policy not in WRITE_POLICIES:
            raise ConfigError(f"write_policy must be one of {list(WRITE_POLICIES)}, got {self.write_policy!r}")
        if not isinstance(self.hash_algo, str) or self.hash_algo not in HASHES:
            raise ConfigError(f"hash_algo must be one of {sorted(HASHES)}, got {self.hash_algo!r}")
        tiers = (self.async_tiers,) if isinstance(self.async_tiers, str) else self.async_tiers
        if not isinstance(tiers, list | tuple) or any(not isinstance(t, str) or t not in TIERS for t in tiers):
            raise ConfigError(f"async_tiers must be a list of tiers among {list(TIERS)}, got {self.async_tiers!r}")
        object.__setattr__(self, "async_tiers", tuple(tiers))
        if not isinstance(self.async_when_idle, bool):
            raise ConfigError(f"async_when_idle must be true or false, got {self.async_when_idle!r}")
        for name in ("retry_s", "timeout_s", "lookup_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive, finite number of seconds, got {value!r}")

    @property
    def is_daemon(self) -> bool:
        return self.store != "embedded"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Build from the extra config dict; ConfigError naming any key that is not a setting."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        return cls(**extra)

    def describe(self) -> str:
        """One log line; never the token."""
        if self.is_daemon:
            return f"daemon {self.store}"
        disk = f", disk {self.disk_path} ({self.disk_bytes} B)" if self.disk_path else ""
        remote = ", a remote tier" if self.remote_url else ""  # the URL may hold a password
        return f"embedded store (host {self.host_bytes} B{disk}{remote}, {self.write_policy})"
