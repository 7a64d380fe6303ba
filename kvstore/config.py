"""StoreConfig: every knob of a TieredStore, validated once, frozen."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.codecs import CODECS, get_codec, stored_bytes
from kvstore.errors import ConfigError, LayoutMismatchError
from kvstore.eviction import DEFAULT_POLICY, POLICIES
from kvstore.keys import HASHES
from kvstore.layout import KVLayout

PAGE = 4096
WRITE_POLICIES = ("write_back", "write_through")
DISK_ADMISSIONS = ("all", "seen_twice")
PROMOTIONS = ("get", "lookup", "never")
REMOTE_WRITES = ("put", "demote")


@dataclass(frozen=True)
class StoreConfig:
    """Configuration of a TieredStore.

    Attributes:
        layout: the KV geometry every block has.
        model_id: names the model; with the layout it forms the key namespace.
        host_bytes: hard capacity of the host RAM tier.
        disk_path: directory of the disk tier (slab file + LMDB catalog); None: no disk tier.
        disk_bytes: hard capacity of the disk tier.
        hash_algo: "sha256" (default) or "xxh3_128" (non-cryptographic: single tenant only).
        write_policy: "write_back" (a put lands in host; host evictions demote to disk) or
            "write_through" (a put is also written to disk before it returns).
        disk_admission: "all" blocks, or only blocks "seen_twice" (put, then used again).
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
            (kvstore.codecs: "none", "int8", "int8-fp32", "fp8"). A lossy tier holds about
            half the bytes per block (twice the blocks fit) and a get from it returns the
            decoded values, not the bytes put (``get(exact=True)`` refuses those).
            ``remote_codec`` applies to the remote tier (``remote_url``).
        remote_url: a shared remote tier below the local ones (docs/remote.md):
            ``redis://``, ``rediss://``, ``redis+cluster://h:p,h:p`` or ``rediss+cluster://``;
            None: none. Never shown in repr (it may hold a password).
        remote_writes: which blocks go remote, in the background: every "put" (write-behind
            from host), or only blocks that "demote" out of the local tiers.
        remote_timeout_s: socket timeout and per-call deadline of the remote tier.
        remote_queue_blocks: the remote write-behind queue bound; beyond it blocks are dropped.
        remote_prefix: first part of every Redis key name (one per deployment sharing a cluster).
    """

    layout: KVLayout
    model_id: str = "default"
    host_bytes: int = 1 << 30
    disk_path: str | os.PathLike[str] | None = None
    disk_bytes: int = 0
    hash_algo: str = "sha256"
    write_policy: str = "write_back"
    disk_admission: str = "all"
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

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise ConfigError(f"layout must be a KVLayout, got {type(self.layout).__name__}")
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ConfigError(f"model_id must be a non-empty string, got {self.model_id!r}")
        for name in ("host_codec", "disk_codec", "remote_codec"):
            value = getattr(self, name)
            if value not in CODECS:
                raise ConfigError(f"{name} must be one of {list(CODECS)}, got {value!r}")
            try:
                get_codec(value).encoded_bytes(self.layout)
            except LayoutMismatchError as e:
                raise ConfigError(f"{name}={value!r}: {e}") from e
        if get_codec(self.host_codec).lossy and not get_codec(self.disk_codec).lossy and self.disk_path is not None:
            raise ConfigError(f"disk_codec={self.disk_codec!r} below host_codec={self.host_codec!r} would store "
                              "decoded values at full size; give the disk a lossy codec too")
        if self.shared_host and get_codec(self.host_codec).lossy:
            raise ConfigError(f"shared_host needs host_codec='none' (other processes map raw slots), "
                              f"got {self.host_codec!r}")
        slot = self.tier_slot_bytes("host")
        if not isinstance(self.host_bytes, int) or self.host_bytes < slot:
            raise ConfigError(
                f"host_bytes={self.host_bytes} is smaller than one block slot ({slot} bytes for "
                f"{self.layout.bytes_per_block}-byte blocks)"
            )
        if self.disk_path is not None:
            slot = self.tier_slot_bytes("disk")
            if not isinstance(self.disk_bytes, int) or self.disk_bytes < slot:
                raise ConfigError(
                    f"disk_bytes={self.disk_bytes} is smaller than one block slot ({slot} bytes); "
                    "set disk_path=None for no disk tier"
                )
            object.__setattr__(self, "disk_path", Path(self.disk_path))
        for name, value, allowed in (
            ("hash_algo", self.hash_algo, tuple(HASHES)),
            ("write_policy", self.write_policy, WRITE_POLICIES),
            ("disk_admission", self.disk_admission, DISK_ADMISSIONS),
            ("promotion", self.promotion, PROMOTIONS),
            ("host_policy", self.host_policy, tuple(POLICIES)),
            ("disk_policy", self.disk_policy, tuple(POLICIES)),
            ("remote_writes", self.remote_writes, REMOTE_WRITES),
        ):
            if value not in allowed:
                raise ConfigError(f"{name} must be one of {list(allowed)}, got {value!r}")
        if self.write_policy == "write_through" and self.disk_path is None:
            raise ConfigError("write_policy='write_through' needs a disk tier (disk_path)")
        if not isinstance(self.transfer_threads, int) or self.transfer_threads < 1:
            raise ConfigError(f"transfer_threads must be >= 1, got {self.transfer_threads!r}")
        self._check_remote()

    def _check_remote(self) -> None:
        if self.remote_url is None:
            return
        from kvstore.tiers.remote.naming import check_prefix
        from kvstore.tiers.remote.url import parse_url

        try:
            parse_url(self.remote_url)  # the message shows the URL redacted
            check_prefix(self.remote_prefix)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not isinstance(self.remote_timeout_s, (int, float)) or not self.remote_timeout_s > 0:
            raise ConfigError(f"remote_timeout_s must be positive, got {self.remote_timeout_s!r}")
        if not isinstance(self.remote_queue_blocks, int) or self.remote_queue_blocks < 1:
            raise ConfigError(f"remote_queue_blocks must be >= 1, got {self.remote_queue_blocks!r}")

    @property
    def slot_bytes(self) -> int:
        """Bytes one raw block occupies in a tier (payload rounded up to 4 KiB)."""
        return -(-self.layout.bytes_per_block // PAGE) * PAGE

    def tier_slot_bytes(self, tier: str) -> int:
        """Bytes one block occupies in ``tier`` ("host", "disk", "remote") under its codec."""
        codec = get_codec(getattr(self, f"{tier}_codec"))
        return -(-stored_bytes(codec, self.layout, PAGE) // PAGE) * PAGE

    @property
    def has_disk(self) -> bool:
        return self.disk_path is not None

    @property
    def has_remote(self) -> bool:
        return self.remote_url is not None
