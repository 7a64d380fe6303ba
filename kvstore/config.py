"""StoreConfig: every knob of a TieredStore, validated once, frozen."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvstore.admission import ADMISSIONS
from kvstore.codecs import CODECS, get_codec, stored_bytes
from kvstore.errors import ConfigError, LayoutMismatchError
from kvstore.eviction import DEFAULT_POLICY, POLICIES
from kvstore.kernels.pages import PAGE_CODES, SCALE_BYTES
from kvstore.keys import HASHES
from kvstore.layout import KVLayout

if TYPE_CHECKING:
    from kvstore.settings import StoreSettings

PAGE = 4096
WRITE_POLICIES = ("write_back", "write_through")
DISK_ADMISSIONS = ADMISSIONS  # kvstore/admission.py; the same names for remote_admission
REMOTE_ADMISSIONS = ADMISSIONS
PROMOTIONS = ("get", "lookup", "never")
REMOTE_WRITES = ("put", "demote")
CODEC_FIELDS = ("host_codec", "disk_codec", "remote_codec")


def check_store_knobs(knobs: StoreConfig | StoreSettings) -> None:
    """Validate the knobs that need no layout; StoreConfig and StoreSettings both call this,
    so a setting is refused with the same message before a model is known as after.
    Turns ``disk_path`` into a Path (both classes are frozen, hence ``object.__setattr__``).

    Raises:
        ConfigError: naming the knob, the allowed values and the value (never the remote
            URL: its message shows it redacted).
    """
    for name in CODEC_FIELDS:
        value = getattr(knobs, name)
        if value not in CODECS:
            raise ConfigError(f"{name} must be one of {list(CODECS)}, got {value!r}")
    if get_codec(knobs.host_codec).lossy and not get_codec(knobs.disk_codec).lossy and knobs.disk_path is not None:
        raise ConfigError(f"disk_codec={knobs.disk_codec!r} below host_codec={knobs.host_codec!r} would store "
                          "decoded values at full size; give the disk a lossy codec too")
    for name in ("host_bytes", "disk_bytes"):
        value = getattr(knobs, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{name} must be an int of bytes >= 0, got {value!r}")
    if knobs.disk_path is not None:
        if not isinstance(knobs.disk_path, (str, os.PathLike)) or not str(knobs.disk_path):
            raise ConfigError(f"disk_path must be a directory path or None, got {knobs.disk_path!r}")
        object.__setattr__(knobs, "disk_path", Path(knobs.disk_path))
    for name, value, allowed in (
        ("hash_algo", knobs.hash_algo, tuple(HASHES)),
        ("write_policy", knobs.write_policy, WRITE_POLICIES),
        ("disk_admission", knobs.disk_admission, DISK_ADMISSIONS),
        ("remote_admission", knobs.remote_admission, REMOTE_ADMISSIONS),
        ("promotion", knobs.promotion, PROMOTIONS),
        ("remote_writes", knobs.remote_writes, REMOTE_WRITES),
    ):
        if value not in allowed:
            raise ConfigError(f"{name} must be one of {list(allowed)}, got {value!r}")
    if knobs.remote_url is None:
        return
    from kvstore.tiers.remote.naming import check_prefix
    from kvstore.tiers.remote.url import parse_url

    if not isinstance(knobs.remote_url, str):
        raise ConfigError(f"remote_url must be a string, got a {type(knobs.remote_url).__name__}")
    try:
        parse_url(knobs.remote_url)  # the message shows the URL redacted
        check_prefix(knobs.remote_prefix)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    timeout = knobs.remote_timeout_s
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < float("inf"):
        raise ConfigError(f"remote_timeout_s must be a positive number of seconds, got {timeout!r}")
    queue = knobs.remote_queue_blocks
    if not isinstance(queue, int) or isinstance(queue, bool) or queue < 1:
        raise ConfigError(f"remote_queue_blocks must be an int >= 1, got {queue!r}")


@dataclass(frozen=True)
class StoreConfig:
    """Configuration of a TieredStore: a StoreSettings (the model-independent knobs,
    ``settings`` gives it back; ``StoreSettings.store_config`` builds one from it) plus the
    model and this process's knobs (policies, pinning, sync, direct I/O, threads, shared host).

    Attributes:
        layout: the KV geometry every block has.
        model_id: names the model; with the layout it forms the key namespace.
        host_bytes: hard capacity of the host RAM tier.
        disk_path: directory of the disk tier (slab file + LMDB catalog); None: no disk tier.
        disk_bytes: hard capacity of the disk tier.
        hash_algo: "sha256" (default) or "xxh3_128" (non-cryptographic: single tenant only).
        write_policy: "write_back" (a put lands in host; host evictions demote to disk) or
            "write_through" (a put is also written to disk before it returns).
        disk_admission: which of host's victims the disk takes (kvstore/admission.py): "all",
            those "seen_twice" (put, then used again), or "tinylfu" (those whose recent
            access count beats the disk's next victim's). Applies to demotions (write_back);
            a write-through put's blocks all go to disk.
        remote_admission: which blocks offered to the remote tier are sent: the same names
            ("tinylfu" against no victim: blocks met at least twice by the access sketch).
        promotion: when a disk-only block is copied up to host: on "get"/fetch, also
            ahead of time on "lookup" (asynchronously), or "never".
        host_policy, disk_policy: eviction policy names (see kvstore.eviction.POLICIES).
        pin_host_memory: page-lock the host pool (None: when CUDA is available).
        sync_disk: fdatasync payloads before their catalog entries commit (keep True).
        direct_io: read the disk tier with O_DIRECT where the filesystem allows it.
        transfer_threads: worker threads for asynchronous fetches and prefetches.
        shared_host: back the host pool with a memfd that other processes of this user can
            map (the daemon's same-host fast path); a shared pool is never page-locked.
        host_codec, disk_codec, remote_codec: how each tier represents blocks
            (kvstore.codecs: "none", "int8", "int8-fp32", "fp8", "int4-rot", "int4-norot"). A
            lossy tier holds about a half (8-bit) or a quarter (4-bit) of the bytes per block,
            and a get from it returns the decoded values, not the bytes put
            (``get(exact=True)`` refuses those).
            ``remote_codec`` applies to the remote tier (``remote_url``).
        remote_url: a shared remote tier below the local ones (docs/remote.md):
            ``redis://``, ``rediss://``, ``redis+cluster://h:p,h:p`` or ``rediss+cluster://``;
            None: none. Never shown in repr (it may hold a password).
        remote_writes: which blocks go remote, in the background: every "put" (write-behind
            from host), or only blocks that "demote" out of the local tiers.
        remote_timeout_s: socket timeout and per-call deadline of the remote tier.
        remote_queue_blocks: the remote write-behind queue bound; beyond it blocks are dropped.
        remote_prefix: first part of every Redis key name (one per deployment sharing a cluster).
        pages: "none", or the code ("int8", "fp8") of an engine's quantized device pages
            (kvstore/kernels/pages.py) when the layout's blocks are such pages (uint8, head_dim
            = the model's + 2). A tier whose codec is "none" or the pages' own code keeps them
            as they are (bit for bit); another lossy codec converts them once at its boundary
            (decoded to values, encoded; and back into pages when read).
    """

    layout: KVLayout
    model_id: str = "default"
    host_bytes: int = 1 << 30
    disk_path: str | os.PathLike[str] | None = None
    disk_bytes: int = 0
    hash_algo: str = "sha256"
    write_policy: str = "write_back"
    disk_admission: str = "all"
    remote_admission: str = "all"
    promotion: str = "get"
    host_policy: str = DEFAULT_POLICY
    disk_policy: str = DEFAULT_POLICY
    pin_host_memory: bool | None = None
    sync_disk: bool = True
    direct_io: bool = True
    transfer_threads: int = 2
    shared_host: bool = False
    host_codec: str = "none"
    disk_codec: str = "none"
    remote_codec: str = "none"
    remote_url: str | None = field(default=None, repr=False)
    remote_writes: str = "put"
    remote_timeout_s: float = 0.5
    remote_queue_blocks: int = 256
    remote_prefix: str = "kvstore"
    pages: str = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise ConfigError(f"layout must be a KVLayout, got {type(self.layout).__name__}")
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ConfigError(f"model_id must be a non-empty string, got {self.model_id!r}")
        check_store_knobs(self)
        if self.pages != "none":
            if self.pages not in PAGE_CODES:
                raise ConfigError(f"pages must be 'none' or one of {list(PAGE_CODES)}, got {self.pages!r}")
            if self.layout.dtype != torch.uint8 or self.layout.head_dim <= SCALE_BYTES:
                raise ConfigError(f"pages={self.pages!r} needs a layout of quantized pages (uint8, head_dim = the "
                                  f"model's + {SCALE_BYTES}), got {self.layout.fingerprint()}")
        for name in CODEC_FIELDS:
            try:
                get_codec(self.tier_codec(name.removesuffix("_codec"))).encoded_bytes(self.codec_layout)
            except LayoutMismatchError as e:
                raise ConfigError(f"{name}={getattr(self, name)!r}: {e}") from e
        if self.shared_host and get_codec(self.tier_codec("host")).lossy:
            raise ConfigError(f"shared_host needs host_codec='none' (other processes map raw slots), "
                              f"got {self.host_codec!r}")
        slot = self.tier_slot_bytes("host")
        if self.host_bytes < slot:
            raise ConfigError(
                f"host_bytes={self.host_bytes} is smaller than one block slot ({slot} bytes for "
                f"{self.layout.bytes_per_block}-byte blocks)"
            )
        if self.disk_path is not None:
            slot = self.tier_slot_bytes("disk")
            if self.disk_bytes < slot:
                raise ConfigError(
                    f"disk_bytes={self.disk_bytes} is smaller than one block slot ({slot} bytes); "
                    "set disk_path=None for no disk tier"
                )
        # Not a knob check: a daemon holds write_through for namespaces whose disk share may
        # turn out smaller than one of their blocks (those get no disk tier, see its registry).
        if self.write_policy == "write_through" and self.disk_path is None:
            raise ConfigError("write_policy='write_through' needs a disk tier (disk_path)")
        for name, value in (("host_policy", self.host_policy), ("disk_policy", self.disk_policy)):
            if value not in POLICIES:
                raise ConfigError(f"{name} must be one of {list(POLICIES)}, got {value!r}")
        if not isinstance(self.transfer_threads, int) or self.transfer_threads < 1:
            raise ConfigError(f"transfer_threads must be >= 1, got {self.transfer_threads!r}")

    @property
    def settings(self) -> StoreSettings:
        """The model-independent part of this config (``settings.store_config`` rebuilds it)."""
        from kvstore.settings import StoreSettings

        return StoreSettings(**{name: getattr(self, name) for name in StoreSettings.names()})

    @property
    def slot_bytes(self) -> int:
        """Bytes one raw block occupies in a tier (payload rounded up to 4 KiB)."""
        return -(-self.layout.bytes_per_block // PAGE) * PAGE

    def tier_codec(self, tier: str) -> str:
        """The codec ``tier`` ("host", "disk", "remote") stores blocks with: its ``*_codec``, but
        "none" where that is the pages' own code (pages are kept as they are)."""
        name: str = getattr(self, f"{tier}_codec")
        return "none" if name == self.pages else name

    @property
    def codec_layout(self) -> KVLayout:
        """The layout lossy codecs encode: the store's, or for quantized pages the values they
        decode to (float32, the model's head_dim)."""
        if self.pages == "none":
            return self.layout
        return replace(self.layout, head_dim=self.layout.head_dim - SCALE_BYTES, dtype=torch.float32)

    def tier_slot_bytes(self, tier: str) -> int:
        """Bytes one block occupies in ``tier`` ("host", "disk", "remote") under its codec."""
        codec = get_codec(self.tier_codec(tier))
        if not codec.lossy:
            return self.slot_bytes
        return -(-stored_bytes(codec, self.codec_layout, PAGE) // PAGE) * PAGE

    @property
    def has_disk(self) -> bool:
        return self.disk_path is not None

    @property
    def has_remote(self) -> bool:
        return self.remote_url is not None
