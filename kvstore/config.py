"""The store's one config: ``StoreSettings`` (the knobs that need no model) and ``StoreConfig``
(those settings plus one model and one process's knobs).

Every owner of a store carries one ``StoreSettings``: ``LLMEngine`` (``EngineConfig``), the
daemon (``DaemonConfig``, ``kvstore serve``), ``kvstore engine`` (``EngineServerConfig``) and
the vLLM connector (``ConnectorSettings``). So a knob has one name, one default and one check
everywhere: the CLI flags (kvstore.services.common.store_args), the TOML keys and the
connector's extra-config keys are spelled after these fields, and each field is declared once,
here. Where a constructor takes settings by name (``StoreConfig(layout, host_bytes=...)``,
``LLMEngine(..., disk_path=...)``), ``split_settings`` sorts them out of its other arguments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from kvstore.codecs import AUTO, CODECS, get_codec, sizing_codec, stored_bytes
from kvstore.errors import ConfigError, LayoutMismatchError
from kvstore.kernels.pages import PAGE_CODES, SCALE_BYTES
from kvstore.keys import HASHES
from kvstore.layout import KVLayout
from kvstore.policy.admission import ADMISSIONS
from kvstore.policy.eviction import DEFAULT_POLICY, POLICIES

PAGE = 4096
WRITE_POLICIES = ("write_back", "write_through")
PROMOTIONS = ("get", "lookup", "never")
REMOTE_WRITES = ("put", "demote")
COLD_BLOCKS = ("demote", "drop")
CODEC_FIELDS = ("host_codec", "disk_codec", "remote_codec")


@dataclass(frozen=True)
class StoreSettings:
    """The model-independent knobs of a TieredStore.

    Attributes:
        host_bytes: hard capacity of the host RAM tier (0 is valid here: LLMEngine reads it as
            "no store"; a StoreConfig needs at least one block slot).
        disk_path: directory of the disk tier (slab file + LMDB catalog); None: no disk tier.
        disk_bytes: hard capacity of the disk tier.
        write_policy: "write_back" (a put lands in host; host evictions demote to disk) or
            "write_through" (a put is also written to disk before it returns).
        disk_admission: which of host's victims the disk takes (kvstore/policy/admission.py):
            "all", those "seen_twice" (put, then used again), or "tinylfu" (those whose recent
            access count beats the disk's next victim's). Applies to demotions (write_back);
            a write-through put's blocks all go to disk.
        remote_admission: which blocks offered to the remote tier are sent: the same names
            ("tinylfu" against no victim: blocks met at least twice by the access sketch).
        promotion: when a disk-only block is copied up to host: on "get"/fetch, also
            ahead of time on "lookup" (asynchronously), or "never".
        host_codec, disk_codec, remote_codec: how each tier represents blocks
            (kvstore.codecs: "none", "int8", "int8-fp32", "fp8", "int4-rot", "int4-norot"). A
            lossy tier holds about a half (8-bit) or a quarter (4-bit) of the bytes per block,
            and a get from it returns the decoded values, not the bytes put
            (``get(exact=True)`` refuses those). ``disk_codec="auto"``: int8 where a cold read
            of int8 blocks measured faster than of raw ones on that disk when its directory was
            first used, else none; the choice stays with the directory
            (kvstore/store/levels/codec_choice.py).
        remote_url: a shared remote tier below the local ones (docs/remote.md):
            ``redis://``, ``rediss://``, ``redis+cluster://h:p,h:p`` or ``rediss+cluster://``;
            None: none. Never shown in repr or in errors (it may hold a password).
        remote_writes: which blocks go remote, in the background: every "put" (write-behind
            from host), or only blocks that "demote" out of the local tiers.
        remote_timeout_s: socket timeout and per-call deadline of the remote tier.
        remote_queue_blocks: the remote write-behind queue bound; beyond it blocks are dropped.
        remote_prefix: first part of every Redis key name (one per deployment sharing a cluster).
        hash_algo: the key hash ("sha256"; "xxh3_128", non-cryptographic, only where one
            tenant sends prompts).
        cold_blocks: what becomes of a cooled block (``BlockStore.cool``: a sliding-window
            group's block below the window of every boundary its chain was used at) that host
            RAM evicts: "drop" it (the default: never written down the tiers), or "demote" it like
            any block (for disk to spare and prompts that branch at many boundaries).

    What the check needs a layout for (a capacity of at least one block slot, a codec that
    fits the geometry, write_through having a disk tier) is checked by ``StoreConfig``.
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
    cold_blocks: str = "drop"

    def __post_init__(self) -> None:
        _check_settings(self)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The field names: also the TOML and extra-config keys of the settings."""
        return tuple(f.name for f in fields(cls))

    def store_config(self, layout: KVLayout, model_id: str = "default", **extra: Any) -> StoreConfig:
        """The StoreConfig of these settings for one model.

        Args:
            layout, model_id: the model (they form the key namespace with ``hash_algo``).
            **extra: StoreConfig's own fields (shared_host, pin_host_memory, transfer_threads,
                host_policy, ...). A setting goes through ``dataclasses.replace`` on the
                settings instead, so that it has one source.

        Raises:
            ConfigError: a setting passed in ``extra``, or one the layout refuses (a capacity
                below one block slot, write_through without a disk tier, ...).
        """
        doubled = sorted(set(extra) & set(self.names()))
        if doubled:
            raise ConfigError(f"{doubled} are store settings: pass dataclasses.replace(settings, ...) "
                              "rather than store_config extras")
        return StoreConfig(layout, model_id, self, **extra)

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

    @property
    def has_disk(self) -> bool:
        return self.disk_path is not None

    @property
    def has_remote(self) -> bool:
        return self.remote_url is not None


def split_settings(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(settings, rest)``: the StoreSettings fields among ``kwargs``, and the other arguments."""
    names = set(StoreSettings.names())
    settings = {k: v for k, v in kwargs.items() if k in names}
    return settings, {k: v for k, v in kwargs.items() if k not in names}


def _check_settings(s: StoreSettings) -> None:
    """Validate the knobs that need no layout (``disk_path`` becomes a Path; the class is
    frozen, hence ``object.__setattr__``).

    Raises:
        ConfigError: naming the knob, the allowed values and the value (never the remote
            URL: its message shows it redacted).
    """
    for name in CODEC_FIELDS:
        value = getattr(s, name)
        codecs = [*CODECS, AUTO] if name == "disk_codec" else [*CODECS]
        if value not in codecs:
            raise ConfigError(f"{name} must be one of {codecs}, got {value!r}")
    if s.disk_codec == AUTO and get_codec(s.host_codec).lossy and s.disk_path is not None:
        raise ConfigError(f"disk_codec='auto' may choose none below host_codec={s.host_codec!r}, which would "
                          "store decoded values at full size; name the disk's codec")
    if s.disk_codec != AUTO and get_codec(s.host_codec).lossy and not get_codec(s.disk_codec).lossy \
            and s.disk_path is not None:
        raise ConfigError(f"disk_codec={s.disk_codec!r} below host_codec={s.host_codec!r} would store "
                          "decoded values at full size; give the disk a lossy codec too")
    for name in ("host_bytes", "disk_bytes"):
        value = getattr(s, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{name} must be an int of bytes >= 0, got {value!r}")
    if s.disk_path is not None:
        if not isinstance(s.disk_path, (str, os.PathLike)) or not str(s.disk_path):
            raise ConfigError(f"disk_path must be a directory path or None, got {s.disk_path!r}")
        object.__setattr__(s, "disk_path", Path(s.disk_path))
    for name, value, allowed in (
        ("hash_algo", s.hash_algo, tuple(HASHES)),
        ("write_policy", s.write_policy, WRITE_POLICIES),
        ("disk_admission", s.disk_admission, ADMISSIONS),
        ("remote_admission", s.remote_admission, ADMISSIONS),
        ("promotion", s.promotion, PROMOTIONS),
        ("remote_writes", s.remote_writes, REMOTE_WRITES),
        ("cold_blocks", s.cold_blocks, COLD_BLOCKS),
    ):
        if value not in allowed:
            raise ConfigError(f"{name} must be one of {list(allowed)}, got {value!r}")
    if s.remote_url is None:
        return
    from kvstore.tiers.remote.naming import check_prefix
    from kvstore.tiers.remote.url import parse_url

    if not isinstance(s.remote_url, str):
        raise ConfigError(f"remote_url must be a string, got a {type(s.remote_url).__name__}")
    try:
        parse_url(s.remote_url)  # the message shows the URL redacted
        check_prefix(s.remote_prefix)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    timeout = s.remote_timeout_s
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < float("inf"):
        raise ConfigError(f"remote_timeout_s must be a positive number of seconds, got {timeout!r}")
    queue = s.remote_queue_blocks
    if not isinstance(queue, int) or isinstance(queue, bool) or queue < 1:
        raise ConfigError(f"remote_queue_blocks must be an int >= 1, got {queue!r}")


@dataclass(frozen=True, init=False)
class StoreConfig:
    """Configuration of one TieredStore: a model, its StoreSettings, and this process's knobs.

    ``StoreConfig(layout, model_id, settings)``; settings may also be given by name, as
    keyword shortcuts folded into ``settings``: ``StoreConfig(layout, host_bytes=1 << 30)``
    is ``StoreConfig(layout, settings=StoreSettings(host_bytes=1 << 30))``. Read them back
    from ``settings``.

    Attributes:
        layout: the KV geometry every block has.
        model_id: names the model; with the layout and ``settings.hash_algo`` it forms the key
            namespace.
        settings: the tiers (StoreSettings: sizes, disk path, codecs, policies, remote tier).
        host_policy, disk_policy: eviction policy names (kvstore.policy.eviction.POLICIES).
        pin_host_memory: page-lock the host pool (None: when CUDA is available).
        sync_disk: fdatasync payloads before their catalog entries commit (keep True).
        direct_io: read the disk tier with O_DIRECT where the filesystem allows it.
        transfer_threads: worker threads for asynchronous fetches and prefetches.
        shared_host: back the host pool with a memfd that other processes of this user can
            map (the daemon's same-host fast path); a shared pool is never page-locked.
        pages: "none", or the code ("int8", "fp8") of an engine's quantized device pages
            (kvstore/kernels/pages.py) when the layout's blocks are such pages (uint8, head_dim
            = the model's + 2). A tier whose codec is "none" or the pages' own code keeps them
            as they are (bit for bit); another lossy codec converts them once at its boundary
            (decoded to values, encoded; and back into pages when read).

    Raises:
        ConfigError: a knob out of range, or a setting the layout refuses (a capacity below
            one block slot, a codec that does not fit it, write_through without a disk).
    """

    layout: KVLayout
    model_id: str = "default"
    settings: StoreSettings = field(default_factory=StoreSettings)
    host_policy: str = DEFAULT_POLICY
    disk_policy: str = DEFAULT_POLICY
    pin_host_memory: bool | None = None
    sync_disk: bool = True
    direct_io: bool = True
    transfer_threads: int = 2
    shared_host: bool = False
    pages: str = "none"

    def __init__(self, layout: KVLayout, model_id: str = "default", settings: StoreSettings | None = None, *,
                 host_policy: str = DEFAULT_POLICY, disk_policy: str = DEFAULT_POLICY,
                 pin_host_memory: bool | None = None, sync_disk: bool = True, direct_io: bool = True,
                 transfer_threads: int = 2, shared_host: bool = False, pages: str = "none",
                 **knobs: Any) -> None:
        given, unknown = split_settings(knobs)
        if unknown:
            raise ConfigError(f"StoreConfig got unknown knobs {sorted(unknown)}; the settings are "
                              f"{list(StoreSettings.names())}")
        if settings is None:
            settings = StoreSettings(**given)
        elif not isinstance(settings, StoreSettings):
            raise ConfigError(f"settings must be a StoreSettings, got {type(settings).__name__}")
        elif given:
            settings = replace(settings, **given)
        values = {"layout": layout, "model_id": model_id, "settings": settings, "host_policy": host_policy,
                  "disk_policy": disk_policy, "pin_host_memory": pin_host_memory, "sync_disk": sync_disk,
                  "direct_io": direct_io, "transfer_threads": transfer_threads, "shared_host": shared_host,
                  "pages": pages}
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._check()

    def _check(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise ConfigError(f"layout must be a KVLayout, got {type(self.layout).__name__}")
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ConfigError(f"model_id must be a non-empty string, got {self.model_id!r}")
        s = self.settings
        if self.pages != "none":
            if self.pages not in PAGE_CODES:
                raise ConfigError(f"pages must be 'none' or one of {list(PAGE_CODES)}, got {self.pages!r}")
            if self.layout.dtype != torch.uint8 or self.layout.head_dim <= SCALE_BYTES:
                raise ConfigError(f"pages={self.pages!r} needs a layout of quantized pages (uint8, head_dim = the "
                                  f"model's + {SCALE_BYTES}), got {self.layout.fingerprint()}")
        for name in CODEC_FIELDS:
            if getattr(s, name) == AUTO:  # chosen when the store opens, among codecs that fit
                continue
            try:
                get_codec(self.tier_codec(name.removesuffix("_codec"))).encoded_bytes(self.codec_layout)
            except LayoutMismatchError as e:
                raise ConfigError(f"{name}={getattr(s, name)!r}: {e}") from e
        if self.shared_host and get_codec(self.tier_codec("host")).lossy:
            raise ConfigError(f"shared_host needs host_codec='none' (other processes map raw slots), "
                              f"got {s.host_codec!r}")
        slot = self.tier_slot_bytes("host")
        if s.host_bytes < slot:
            raise ConfigError(
                f"host_bytes={s.host_bytes} is smaller than one block slot ({slot} bytes for "
                f"{self.layout.bytes_per_block}-byte blocks)"
            )
        if s.disk_path is not None:
            slot = self.tier_slot_bytes("disk")
            if s.disk_bytes < slot:
                raise ConfigError(
                    f"disk_bytes={s.disk_bytes} is smaller than one block slot ({slot} bytes); "
                    "set disk_path=None for no disk tier"
                )
        # Not a knob check: a daemon holds write_through for namespaces whose disk share may
        # turn out smaller than one of their blocks (those get no disk tier, see its registry).
        if s.write_policy == "write_through" and s.disk_path is None:
            raise ConfigError("write_policy='write_through' needs a disk tier (disk_path)")
        for name, value in (("host_policy", self.host_policy), ("disk_policy", self.disk_policy)):
            if value not in POLICIES:
                raise ConfigError(f"{name} must be one of {list(POLICIES)}, got {value!r}")
        if not isinstance(self.transfer_threads, int) or self.transfer_threads < 1:
            raise ConfigError(f"transfer_threads must be >= 1, got {self.transfer_threads!r}")

    @property
    def slot_bytes(self) -> int:
        """Bytes one raw block occupies in a tier (payload rounded up to 4 KiB)."""
        return -(-self.layout.bytes_per_block // PAGE) * PAGE

    def tier_codec(self, tier: str) -> str:
        """The codec ``tier`` ("host", "disk", "remote") stores blocks with: its ``*_codec``, but
        "none" where that is the pages' own code (pages are kept as they are)."""
        name: str = getattr(self.settings, f"{tier}_codec")
        return "none" if name == self.pages else name

    @property
    def codec_layout(self) -> KVLayout:
        """The layout lossy codecs encode: the store's, or for quantized pages the values they
        decode to (float32, the model's head_dim)."""
        if self.pages == "none":
            return self.layout
        return replace(self.layout, head_dim=self.layout.head_dim - SCALE_BYTES, dtype=torch.float32)

    def tier_slot_bytes(self, tier: str) -> int:
        """Bytes one block occupies in ``tier`` ("host", "disk", "remote") under its codec (a
        raw block's under ``disk_codec="auto"`` until the store has chosen: the larger)."""
        codec = sizing_codec(self.tier_codec(tier))
        if not codec.lossy:
            return self.slot_bytes
        return -(-stored_bytes(codec, self.codec_layout, PAGE) // PAGE) * PAGE
