"""EngineServerConfig: every knob of ``kvstore engine``, frozen and validated (the loopback rule too)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.config import StoreSettings
from kvstore.errors import ConfigError
from kvstore.services.common.net import is_loopback
from kvstore.services.common.store_args import flag_of


@dataclass(frozen=True)
class EngineServerConfig:
    """Configuration of one ``kvstore engine`` process.

    Attributes:
        model: a Hugging Face checkpoint directory; None serves the seeded random model (with
            the byte tokenizer), shaped by ``random_config`` (ModelConfig field overrides).
        host, port: where the HTTP API listens (port 0: any free port, printed at start).
        served_model_name: the ``model`` clients name (default: the directory or .gguf file name, or "random").
        store_url: a daemon address (unix:// or tcp://) for the host and disk tiers, or None
            for an embedded store built from ``store_settings``.
        store_settings: the embedded store's tiers (sizes, disk path, codecs, write policy,
            promotion, remote tier; kvstore.StoreSettings). With ``store_url`` they stay the
            defaults: the daemon's own settings hold.
        store_token: the daemon token (None: KVSTORE_TOKEN).
        tokens_file: TOML mapping Bearer tokens to tenants (the daemon's format, docs/protocol.md).
        router_token: the secret with which a trusted front may name the tenant in a header
            (the CLI's default: KVSTORE_ROUTER_TOKEN).
        kv_events: a ZeroMQ endpoint to publish KV events on (None: none); ``kv_events_replay``
            its replay/snapshot socket (None: the next port, "": none). docs/kv-events.md.
        drain_s: seconds SIGTERM waits for requests in flight before cancelling them.
        engine: the remaining LLMEngine settings (device, dtype, kv_cache_bytes, block_size, ...).
    """

    model: str | None = None
    random_config: dict[str, Any] | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    store_url: str | None = None
    store_token: str | None = field(default=None, repr=False)
    store_settings: StoreSettings = field(default_factory=StoreSettings)
    tokens_file: str | None = None
    router_token: str | None = field(default=None, repr=False)
    kv_events: str | None = None
    kv_events_replay: str | None = None
    drain_s: float = 10.0
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    kv_cache_bytes: int = 1 << 28
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    device_write_policy: str = "write_through"
    prepack_weights: bool = True
    cpu_decode_kernel: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not is_loopback(self.host) and not (self.tokens_file or self.router_token):
            raise ConfigError(f"--host {self.host} is off loopback: tenant tokens are required "
                              "(--tokens FILE and/or --router-token)")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65536), got {self.port!r}")
        if self.model is not None and self.random_config is not None:
            raise ConfigError("--random-config applies only to --random-model")
        if self.model is not None and not os.path.exists(self.model):
            raise ConfigError(f"model {self.model} does not exist (a Hugging Face checkpoint directory or a .gguf file)")
        if self.tokens_file is not None and not os.path.isfile(self.tokens_file):
            raise ConfigError(f"tokens file {self.tokens_file} does not exist")
        if not self.drain_s >= 0:
            raise ConfigError(f"drain_s must be >= 0, got {self.drain_s}")
        if not isinstance(self.store_settings, StoreSettings):
            raise ConfigError(f"store_settings must be a StoreSettings, got {type(self.store_settings).__name__}")
        changed = self.store_settings.changed_from()
        if self.store_url is not None and changed:
            raise ConfigError(f"{', '.join(flag_of(name) for name in changed)} set the embedded store; with "
                              "--store-url the daemon's tiers serve, set by kvstore serve")

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return os.path.basename(os.path.normpath(self.model)).removesuffix(".gguf") if self.model else "random"

    def engine_kwargs(self) -> dict[str, Any]:
        """LLMEngine keyword arguments (EngineConfig validates them)."""
        kw: dict[str, Any] = dict(device=self.device, dtype=self.dtype, kv_cache_bytes=self.kv_cache_bytes,
                                  kv_cache_dtype=self.kv_cache_dtype,
                                  block_size=self.block_size, max_model_len=self.max_model_len,
                                  max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                  device_write_policy=self.device_write_policy,
                                  prepack_weights=self.prepack_weights, cpu_decode_kernel=self.cpu_decode_kernel,
                                  seed=self.seed)
        if self.store_url is not None:
            kw.update(store_url=self.store_url, store_token=self.store_token)
        else:
            kw.update(store_settings=self.store_settings)
        if self.model is None:
            kw["random_model"] = self.random_config
        if self.kv_events is not None:
            kw.update(kv_events=self.kv_events, kv_events_replay=self.kv_events_replay)
        return kw


def __getattr__(name: str) -> object:
    """``ServeConfig``, the old name of ``EngineServerConfig`` (it configures ``kvstore engine``,
    not ``kvstore serve``): still importable, with a DeprecationWarning."""
    if name == "ServeConfig":
        import warnings

        warnings.warn("ServeConfig is named EngineServerConfig now", DeprecationWarning, stacklevel=2)
        return EngineServerConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
