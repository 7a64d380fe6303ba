"""StoreSettings: the store knobs that need no model, one object every service carries.

A StoreConfig is these settings plus a model (layout and model id) and the knobs of one
process (shared host memory, page-locking, transfer threads). The daemon, ``kvstore engine``,
LLMEngine and the vLLM connector each hold one StoreSettings and build their stores from it
(``store_config``), so a knob has one name, one default and one check everywhere: the CLI
flags (kvstore.services.common.store_args) and the TOML and extra-config keys are spelled
after these fields.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from kvstore.config import StoreConfig, check_store_knobs
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout


@dataclass(frozen=True)
class StoreSettings:
    """The model-independent knobs of a TieredStore; defaults and meanings are StoreConfig's.

    Attributes:
        host_bytes: hard capacity of the host RAM tier (0 is valid here: LLMEngine reads it as
            "no store"; a StoreConfig needs at least one block slot).
        disk_path, disk_bytes: the disk tier's directory (None: no disk tier) and capacity.
        write_policy, disk_admission, remote_admission, promotion: see StoreConfig.
        host_codec, disk_codec, remote_codec: how each tier represents blocks (kvstore.codecs).
        remote_url: the shared remote tier (docs/remote.md); None: none. Never shown in repr
            or in errors (it may hold a password).
        remote_writes, remote_timeout_s, remote_queue_blocks, remote_prefix: the remote
            tier's write mode, deadline, write-behind bound and key prefix.
        hash_algo: the key hash ("sha256"; "xxh3_128" only where one tenant sends prompts).

    What the check needs a layout for (a capacity of at least one block slot, a codec that
    fits the geometry, write_through having a disk tier) is checked by ``store_config``.
    """

    host_bytes: int = 1 << 30
    disk_path: str | os.PathLike[str] | None = None
    disk_bytes: int = 0
    write_policy: str = "write_back"
    disk_admission: str = "all"
    remote_admission: str = "all"
    promotion: str = "get"
    host_codec: str = "none"
    disk_codec: str = "none"
    remote_codec: str = "none"
    remote_url: str | None = field(default=None, repr=False)
    remote_writes: str = "put"
    remote_timeout_s: float = 0.5
    remote_queue_blocks: int = 256
    remote_prefix: str = "kvstore"
    hash_algo: str = "sha256"

    def __post_init__(self) -> None:
        check_store_knobs(self)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The field names: also the TOML and extra-config keys of the settings."""
        return tuple(f.name for f in fields(cls))

    def store_config(self, layout: KVLayout, model_id: str = "default", **extra: Any) -> StoreConfig:
        """The StoreConfig of these settings for one model.

        Args:
            layout, model_id: the model (they form the key namespace with ``hash_algo``).
            **extra: StoreConfig fields that are not settings (shared_host, pin_host_memory,
                transfer_threads, host_policy, ...). A setting goes through
                ``dataclasses.replace`` on the settings instead, so that it has one source.

        Raises:
            ConfigError: a setting passed in ``extra``, or one the layout refuses (a capacity
                below one block slot, write_through without a disk tier, ...).
        """
        doubled = sorted(set(extra) & set(self.names()))
        if doubled:
            raise ConfigError(f"{doubled} are store settings: pass dataclasses.replace(settings, ...) "
                              "rather than store_config extras")
        return StoreConfig(layout=layout, model_id=model_id, **self._values(), **extra)

    def changed_from(self, base: StoreSettings | None = None) -> list[str]:
        """Names of the settings whose value differs from ``base`` (default: the defaults)."""
        base = StoreSettings() if base is None else base
        return [name for name in self.names() if getattr(self, name) != getattr(base, name)]

    def describe(self) -> str:
        """One log line: the tiers and their codecs; never the remote URL."""
        parts = [f"host {self.host_bytes} B" + (f" {self.host_codec}" if self.host_codec != "none" else "")]
        if self.disk_path is not None:
            codec = f" {self.disk_codec}" if self.disk_codec != "none" else ""
            parts.append(f"disk {self.disk_path} ({self.disk_bytes} B{codec})")
        if self.remote_url is not None:
            parts.append("a remote tier" + (f" {self.remote_codec}" if self.remote_codec != "none" else ""))
        return ", ".join([*parts, self.write_policy])

    def _values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.names()}
