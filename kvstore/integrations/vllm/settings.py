"""ConnectorSettings: the connector's ``kv_connector_extra_config``, validated and frozen.

Imports nothing from vLLM, so the settings can be checked (and documented) without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field, fields, replace
from typing import Any

from kvstore.client.client import parse_address
from kvstore.config import StoreSettings
from kvstore.errors import ConfigError
from kvstore.services.common.sizes import parse_size

TIERS = ("host", "disk", "remote")
SHORTCUTS = ("host_bytes", "disk_path", "disk_bytes", "write_policy", "remote_url")  # keyword shortcuts
_SIZES = ("host_bytes", "disk_bytes")
_TEXT = ("disk_path", "remote_url", "remote_prefix")  # optional text settings: unset or a non-empty str


def _fold(base: StoreSettings, values: Mapping[str, Any]) -> StoreSettings:
    """``base`` with extra-config store keys over it: sizes may be text ("2GiB"), a disk path
    needs a disk size. ConfigError naming the key (never a remote URL's value)."""
    values = dict(values)
    for name in _TEXT:
        value = values.get(name, "")
        if name in values and value is not None and (not isinstance(value, str) or not value):
            shown = f"a {type(value).__name__}" if name == "remote_url" else repr(value)
            raise ConfigError(f"{name} must be a non-empty string or unset, got {shown}")
    for name in _SIZES:
        if name in values:
            try:
                values[name] = parse_size(values[name])
            except ConfigError as exc:
                raise ConfigError(f"{name}: {exc}") from None
    settings = replace(base, **values)
    if settings.disk_path is not None and settings.disk_bytes <= 0:
        raise ConfigError(f"disk_path={str(settings.disk_path)!r} needs disk_bytes > 0")
    return settings


@dataclass(frozen=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` may hold (every key optional).

    Attributes:
        store: ``unix:///path/kvstore.sock`` or ``tcp://HOST:PORT`` of a kvstore daemon
            (several vLLM processes share it), or "embedded" (default): a TieredStore in
            this process, which needs the scheduler and the worker in one process.
        token: the daemon token (default: KVSTORE_TOKEN); it names the daemon-side tenant.
        store_settings: the embedded store's tiers (kvstore.StoreSettings); ignored for a
            daemon (``kvstore serve`` sets a daemon's). In the extra config every StoreSettings
            field is a key of its own (``host_bytes``, ``disk_path``, ``disk_codec``,
            ``remote_url``, ...; sizes as ints or text like ``"2GiB"``); ``remote_url`` is a
            remote tier shared with other nodes (docs/remote.md).
        host_bytes, disk_path, disk_bytes, write_policy, remote_url: keyword shortcuts for
            those settings, folded into ``store_settings``; not attributes.
        model_id: the namespace's model identity, when the checkpoint path is not stable
            across machines (default: derived from vLLM's model config, see identity.py).
        hash_algo: the key hash of the namespace, the daemon's or the embedded store's
            ("sha256"; "xxh3_128" only where one tenant sends prompts); it is also
            ``store_settings.hash_algo`` (a non-default value in either one sets both).
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
    store_settings: StoreSettings = field(default_factory=StoreSettings)
    model_id: str | None = None
    hash_algo: str = "sha256"
    async_tiers: tuple[str, ...] = ("disk", "remote")
    async_when_idle: bool = False
    retry_s: float = 10.0
    timeout_s: float = 10.0
    lookup_timeout_s: float = 1.0
    host_bytes: InitVar[int | str | None] = None
    disk_path: InitVar[str | None] = None
    disk_bytes: InitVar[int | str | None] = None
    write_policy: InitVar[str | None] = None
    remote_url: InitVar[str | None] = None

    def __post_init__(self, host_bytes: int | str | None, disk_path: str | None, disk_bytes: int | str | None,
                      write_policy: str | None, remote_url: str | None) -> None:
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
        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id):
            raise ConfigError(f"model_id must be a non-empty string or unset, got {self.model_id!r}")
        if not isinstance(self.store_settings, StoreSettings):
            raise ConfigError(f"store_settings must be a StoreSettings, got {type(self.store_settings).__name__}")
        shortcuts = dict(zip(SHORTCUTS, (host_bytes, disk_path, disk_bytes, write_policy, remote_url), strict=True))
        given = {name: value for name, value in shortcuts.items() if value is not None}
        settings = _fold(self.store_settings, given)
        if self.hash_algo != settings.hash_algo:  # the one that is not the default sets both
            default = StoreSettings().hash_algo
            if self.hash_algo != default and settings.hash_algo != default:
                raise ConfigError(f"hash_algo={self.hash_algo!r} and store_settings.hash_algo="
                                  f"{settings.hash_algo!r} differ; give one")
            if self.hash_algo == default:
                object.__setattr__(self, "hash_algo", settings.hash_algo)
            else:
                settings = replace(settings, hash_algo=self.hash_algo)  # validates the name
        object.__setattr__(self, "store_settings", settings)
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
        """Build from the extra config dict: the connector's own keys, and the store settings
        by their StoreSettings names. ConfigError naming any key that is neither."""
        extra = dict(extra or {})
        own = {f.name for f in fields(cls)} - {"store_settings"}
        known = own | set(StoreSettings.names())
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        store = {name: extra.pop(name) for name in StoreSettings.names() if name in extra and name not in own}
        return cls(store_settings=_fold(StoreSettings(), store), **extra)

    def describe(self) -> str:
        """One log line; never the token."""
        if self.is_daemon:
            return f"daemon {self.store}"
        return f"embedded store ({self.store_settings.describe()})"
