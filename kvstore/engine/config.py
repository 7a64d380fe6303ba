"""EngineConfig: every knob of an LLMEngine, validated once, frozen."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvstore.api import BlockStore
from kvstore.config import StoreSettings, split_settings
from kvstore.errors import ConfigError

FETCH_POLICIES = ("auto", "always", "never")
DEVICE_WRITE_POLICIES = ("write_through", "write_back")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# "auto": the model's dtype; a float dtype; or quantized pages (kvstore/kernels/pages.py)
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of an LLMEngine.

    Attributes:
        model: a Hugging Face checkpoint directory (config.json + *.safetensors) or a .gguf file
            (converted once, kvstore.engine.checkpoint.model_cache), or None for a
            small model with seeded random weights (see ``random_model``).
        device: "cpu" or "cuda" (or "cuda:N").
        dtype: weights and KV dtype: float32, float16 or bfloat16.
        kv_cache_bytes: size of the device KV pool (the device tier).
        kv_cache_dtype: what the device pool holds: "auto" (the model's ``dtype``), a float
            dtype's name, or quantized pages: "int8" / "fp8" (e4m3), one code per value and a
            float16 scale per (token, head) row beside its codes (kvstore/kernels/pages.py):
            about 1.9x the tokens of float16 in the same bytes (3.9x of float32). The attention
            decodes the codes as it reads them. Lossy: the store keeps the pages as they are
            (bit for bit), under a namespace of their own (``model_id`` + ``+kv-int8``), so they
            never meet another pool format's blocks.
        store_settings: the embedded store's tiers (kvstore.StoreSettings: sizes, disk path,
            codecs, write policy, promotion, remote tier); ``store_settings.host_bytes=0``: no
            lower tiers at all. Default: StoreSettings() (1 GiB of host RAM, nothing else).
            ``EngineConfig.build`` and ``LLMEngine`` also take each setting by name
            (``LLMEngine(None, host_bytes=0)``), folded into ``store_settings``.
        fetch_policy: "auto" (fetch a lower-tier run when its estimated fetch time beats its
            estimated recompute time), "always", or "never" (recompute whatever is not on device).
        device_write_policy: when a device block's bytes go to the store: "write_through" (right
            after the step that filled the block, on a background thread; evicting it later is
            free) or "write_back" (when it is evicted: admission then waits for the gather).
        store: a ``kvstore.api.BlockStore`` to use instead of an embedded one (None: see
            ``store_url``). A string here is the old spelling of ``store_url`` (it warns).
        store_url: the address of a kvstore daemon ("unix:///abs/kvstore.sock",
            "unix://relative/kvstore.sock" or "tcp://host:port"), whose host and disk tiers then
            serve as this engine's; None (and no ``store``) builds one from ``store_settings``.
        store_token: the daemon token (None: KVSTORE_TOKEN); it decides the daemon-side tenant.
        block_size: tokens per KV block.
        max_num_batched_tokens: the per-step token budget (decode tokens + prefill chunks).
        max_num_seqs: most sequences running at once.
        max_model_len: context limit; None: the model's max_position_embeddings.
        enable_prefix_caching: look up and share cached prefix blocks (False: compute everything).
        hybrid_kv: a hybrid model's store keeps a block per KV group, and a hit moves a
            sliding-window group's window only (kvstore/engine/groups.py). False: one block of
            every layer, as for a model whose layers all attend fully (as vLLM's
            ``--disable-hybrid-kv-cache-manager``); its hits move every layer of every block.
            The output is the same; the namespace differs (the layout's fingerprint does).
        prepack_weights: on the CPU, reorder the weights once at load into oneDNN's blocked
            layout (float32, or bfloat16 on CPUs with native bf16; ignored elsewhere): decode
            steps run 1.4-1.7x faster products (docs/engine.md). A tied output projection then
            gets a packed copy of its own (vocab x hidden more memory). False: plain torch products.
        cpu_decode_kernel: on the CPU with a float32 pool, decode attention reads the pool's rows
            in place through a C++ kernel built at start (``kvstore.kernels.cpu_rows``; a C++
            compiler and ninja, about 30 s the first time, cached after), instead of copying
            them out for torch's flash kernel. Where it cannot be built the engine warns once
            and keeps the torch path. False: always the torch path.
        model_id: names the model in the key namespace; None derives one from the checkpoint.
        random_model: overrides of the random model's config (only with ``model=None``).
        seed: seed of the random model's weights.
        kv_events: publish the device tier and the embedded store's tiers as KV events on this
            ZeroMQ endpoint (``tcp://127.0.0.1:5557``; docs/kv-events.md); None: no events.
        kv_events_replay: the replay/snapshot socket; None: the next port, "": none.
    """

    model: str | os.PathLike[str] | None = None
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    kv_cache_bytes: int = 1 << 28
    kv_cache_dtype: str = "auto"
    store_settings: StoreSettings = field(default_factory=StoreSettings)
    fetch_policy: str = "auto"
    device_write_policy: str = "write_through"
    store: BlockStore | None = None
    store_url: str | None = None
    store_token: str | None = field(default=None, repr=False)
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    hybrid_kv: bool = True
    prepack_weights: bool = True
    cpu_decode_kernel: bool = True
    model_id: str | None = None
    random_model: dict[str, Any] | None = None
    seed: int = 0
    kv_events: str | None = None
    kv_events_replay: str | None = None

    @classmethod
    def build(cls, model: str | os.PathLike[str] | None = None, **kwargs: Any) -> EngineConfig:
        """An EngineConfig from keyword arguments: its own fields, and any StoreSettings field
        by name (``host_bytes=0``, ``disk_path=...``), folded into ``store_settings``."""
        settings, rest = split_settings(kwargs)
        if settings:
            base = rest.get("store_settings", StoreSettings())
            if not isinstance(base, StoreSettings):
                raise ConfigError(f"store_settings must be a StoreSettings, got {type(base).__name__}")
            rest["store_settings"] = replace(base, **settings)
        return cls(model=model, **rest)

    def __post_init__(self) -> None:
        if not isinstance(self.store_settings, StoreSettings):
            raise ConfigError(f"store_settings must be a StoreSettings, got {type(self.store_settings).__name__}")
        if isinstance(self.store, str):  # the old spelling of a daemon address
            warnings.warn("EngineConfig(store=<address>) is spelled store_url=<address> now; store= takes a "
                          "BlockStore", DeprecationWarning, stacklevel=3)
            if self.store_url is not None:
                raise ConfigError("give the daemon address once: store_url= (store= is its old spelling)")
            object.__setattr__(self, "store_url", self.store)
            object.__setattr__(self, "store", None)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of float32/float16/bfloat16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if str(self.device).split(":")[0] not in DEVICES:
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if str(self.device).startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device={self.device!r} but CUDA is not available")
        if self.fetch_policy not in FETCH_POLICIES:
            raise ConfigError(f"fetch_policy must be one of {list(FETCH_POLICIES)}, got {self.fetch_policy!r}")
        if self.device_write_policy not in DEVICE_WRITE_POLICIES:
            raise ConfigError(f"device_write_policy must be one of {list(DEVICE_WRITE_POLICIES)}, "
                              f"got {self.device_write_policy!r}")
        for name in ("kv_cache_bytes", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        settings = self.store_settings
        external = self.store is not None or self.store_url is not None  # a store not built here
        if self.store is not None and self.store_url is not None:
            raise ConfigError("give either store= (a BlockStore) or store_url= (a daemon address), not both")
        if settings.disk_path is not None and settings.host_bytes == 0 and not external:
            raise ConfigError("a disk tier needs a host tier: set host_bytes > 0 with disk_path")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ConfigError(f"max_model_len must be a positive int or None, got {self.max_model_len!r}")
        if self.random_model is not None and self.model is not None:
            raise ConfigError("random_model overrides apply only to model=None")
        if self.store_token is not None and self.store_url is None:
            raise ConfigError("store_token applies only to a daemon address (store_url=)")
        if self.store_url is not None and (not isinstance(self.store_url, str)
                                           or not self.store_url.startswith(("unix://", "tcp://"))):
            raise ConfigError(f"store_url must be a daemon address unix:///path or tcp://host:port, "
                              f"got {self.store_url!r}")
        if self.kv_events is not None:
            from kvstore.events.config import EventsConfig

            try:
                EventsConfig(self.kv_events, self.kv_events_replay)  # validates both addresses
            except ConfigError as exc:
                raise ConfigError(f"kv_events: {exc}") from None
        elif self.kv_events_replay is not None:
            raise ConfigError("kv_events_replay applies only with kv_events")
        if settings.remote_url is not None and (external or not settings.host_bytes):
            raise ConfigError("remote_url needs the embedded store (host_bytes > 0, no store_url=); a daemon "
                              "takes its remote tier from kvstore serve --remote-url")
        if external:
            # host_bytes alone may differ: ``host_bytes=0`` next to a store is the old spelling of "none"
            changed = [name for name in settings.changed_from() if name != "host_bytes"]
            if changed:
                raise ConfigError(f"store_settings {changed} apply to an embedded store; with store= or "
                                  "store_url= the store's own settings hold (a daemon's: kvstore serve)")


def pool_format(config: EngineConfig) -> tuple[torch.dtype, torch.dtype | None]:
    """``(the pool tensor's dtype, the codes' dtype or None)`` of a config's ``kv_cache_dtype``:
    a float pool holds values; a quantized one is uint8 bytes of codes and scales."""
    from kvstore.kernels import PAGE_CODES
    from kvstore.layout import DTYPES_BY_NAME

    name = config.kv_cache_dtype
    if name == "auto":
        return config.dtype, None
    if name in PAGE_CODES:
        return torch.uint8, PAGE_CODES[name]
    return DTYPES_BY_NAME[name], None
