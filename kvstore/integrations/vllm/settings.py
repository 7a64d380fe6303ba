"""ConnectorSettings: the connector's ``kv_connector_extra_config``, validated and frozen.

Imports nothing from vLLM, so the settings can be checked (and documented) without it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvstore.client.client import parse_address
from kvstore.config import StoreSettings
from kvstore.errors import ConfigError
from kvstore.services.common.sizes import parse_size

TIERS = ("host", "disk", "remote")
# Old spellings of extra-config keys: still accepted, with a warning naming the new one.
RENAMED = {"store": "store_url"}
log = logging.getLogger("kvstore.integrations.vllm")
_SIZES = ("host_bytes", "disk_bytes")
_TEXT = ("disk_path", "remote_url", "remote_prefix")  # optional text settings: unset or a non-empty str


def _fold(base: StoreSettings, values: Mapping[str, Any]) -> StoreSettings:
    """``base`` with extra-config store keys over it: sizes may be text ("2GiB"). ConfigError
    naming the key (never a remote URL's value)."""
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
    return replace(base, **values)


@dataclass(frozen=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` may hold (every key optional).

    Attributes:
        store_url: ``unix:///path/kvstore.sock`` or ``tcp://HOST:PORT`` of a kvstore daemon
            (several vLLM processes share it), or "embedded" (default): a TieredStore in
            this process, which needs the scheduler and the worker in one process. The key
            ``store`` is its old spelling (accepted, with a warning).
        token: the daemon token (default: KVSTORE_TOKEN); it names the daemon-side tenant.
        store_settings: the store's settings (kvstore.StoreSettings). In the extra config every
            StoreSettings field is a key of its own (``host_bytes``, ``disk_path``,
            ``disk_codec``, ``remote_url``, ``hash_algo``, ...; sizes as ints or text like
            ``"2GiB"``). They build the embedded store; for a daemon (``kvstore serve`` sets its
            tiers) only ``hash_algo`` applies: the namespace's key hash.
        model_id: the namespace's model identity, when the checkpoint path is not stable
            across machines (default: derived from vLLM's model config, see identity.py).
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

    store_url: str = "embedded"
    token: str | None = field(default=None, repr=False)
    store_settings: StoreSettings = field(default_factory=StoreSettings)
    model_id: str | None = None
    async_tiers: tuple[str, ...] = ("disk", "remote")
    async_when_idle: bool = False
    retry_s: float = 10.0
    timeout_s: float = 10.0
    lookup_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.store_url, str):
            raise ConfigError(f"store_url must be 'embedded', unix:///path or tcp://host:port, got {self.store_url!r}")
        if self.store_url != "embedded":
            try:
                parse_address(self.store_url)
            except ValueError:
                raise ConfigError(f"store_url must be 'embedded', unix:///path or tcp://host:port, "
                                  f"got {self.store_url!r}") from None
        if self.token is not None and not isinstance(self.token, str):
            raise ConfigError(f"token must be a string, got a {type(self.token).__name__}")  # never the value
        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id):
            raise ConfigError(f"model_id must be a non-empty string or unset, got {self.model_id!r}")
        if not isinstance(self.store_settings, StoreSettings):
            raise ConfigError(f"store_settings must be a StoreSettings, got {type(self.store_settings).__name__}")
        settings = self.store_settings
        if settings.disk_path is not None and settings.disk_bytes <= 0:
            raise ConfigError(f"disk_path={str(settings.disk_path)!r} needs disk_bytes > 0")
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
        return self.store_url != "embedded"

    @property
    def hash_algo(self) -> str:
        """The namespace's key hash (``store_settings.hash_algo``)."""
        return self.store_settings.hash_algo

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Build from the extra config dict: the connector's own keys, and the store settings
        by their StoreSettings names. ConfigError naming any key that is neither."""
        extra = dict(extra or {})
        for old, new in RENAMED.items():
            if old in extra:
                if new in extra:
                    raise ConfigError(f"kv_connector_extra_config has both {old!r} and {new!r}; {old!r} is the old "
                                      f"spelling of {new!r}: give {new!r} once")
                log.warning("kvstore: kv_connector_extra_config key %r is spelled %r now; the old key still "
                            "works", old, new)
                extra[new] = extra.pop(old)
        own = {f.name for f in fields(cls)} - {"store_settings"}
        known = own | set(StoreSettings.names())
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        store = {name: extra.pop(name) for name in StoreSettings.names() if name in extra}
        return cls(store_settings=_fold(StoreSettings(), store), **extra)

    def describe(self) -> str:
        """One log line; never the token."""
        if self.is_daemon:
            return f"daemon {self.store_url}"
        return f"embedded store ({self.store_settings.describe()})"
