"""DaemonConfig: every knob of ``kvstore serve``, from flags and an optional TOML file."""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvstore.codecs import CODECS
from kvstore.config import WRITE_POLICIES
from kvstore.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
          "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4,
          "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """``"512MiB"`` -> 536870912; plain ints pass through. ConfigError for anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"size {text!r} is not a number with an optional unit like 512MiB or 20GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_hostport(text: str) -> tuple[str, int]:
    """``"127.0.0.1:7470"`` or ``"[::1]:7470"`` -> (host, port)."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"address {text!r} is not HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_host_bytes() -> int:
    """A tenth of the machine's RAM, at least 64 MiB, at most 16 GiB."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(64 << 20, min(16 << 30, total // 10))


def default_disk_bytes(data_dir: Path) -> int:
    """A tenth of the free space where the data directory lives, at most 20 GiB."""
    probe = data_dir if data_dir.exists() else data_dir.resolve().parent
    while not probe.exists():
        probe = probe.parent
    return max(64 << 20, min(20 << 30, shutil.disk_usage(probe).free // 10))


@dataclass(frozen=True)
class DaemonConfig:
    """Configuration of ``kvstore serve``.

    Attributes:
        data_dir: the disk tier's directories (one per namespace) and nothing else.
        host_bytes, disk_bytes: hard TOTAL capacities; each of ``max_namespaces`` namespace
            slots gets an equal share (-1: the defaults, ``default_host_bytes`` and
            ``default_disk_bytes``; disk_bytes=0: no disk tier; host RAM cannot be 0, every put
            lands there).
        socket_path: the Unix socket ("" for none; default ``data_dir/kvstore.sock``).
        listen: HOST:PORT of the block protocol over TCP ("" for none).
        http: HOST:PORT of REST and the dashboard ("" for none).
        token: the admin token (also accepted on the block protocol, tenant "").
        tokens_file: TOML mapping tenant tokens to tenants (docs/protocol.md).
        max_namespaces: namespace slots; the capacity split (see docs/architecture.md).
        max_frame: bytes; a longer frame is refused before its body is read.
        max_inflight: requests one connection may have in flight.
        max_connections: connections served at once; more are refused with an error frame.
        lease_s: seconds a shared-memory lease lives.
        write_policy: the stores' write policy; write_through makes an acknowledged put durable.
        shm: offer the shared-memory path to Unix-socket clients.
        drain_s: seconds SIGTERM waits for in-flight requests.
        kv_events: publish every namespace's tiers as KV events on this ZeroMQ endpoint
            (docs/kv-events.md); None: no events.
        kv_events_replay: the replay/snapshot socket; None: the next port, "": none.
        disk_codec: how the disk tier stores blocks ("none", "int8", "int8-fp32", "fp8";
            kvstore.codecs). Host RAM stays raw: same-host clients map its slots.
        remote_codec: the same for the remote tier (``remote``).
        remote: a remote tier every namespace's store shares with other nodes (a Redis
            Cluster, docs/remote.md); None: none. Never shown in repr (it may hold a password:
            prefer the TOML key to the flag, which other users can see in ``ps``).
        remote_writes: "put" (every block, write-behind) or "demote" (blocks leaving the node).
        remote_timeout_s: the remote tier's socket timeout and per-call deadline.
    """

    data_dir: Path = Path(".kvstore")
    host_bytes: int = -1
    disk_bytes: int = -1
    socket_path: str | None = None
    listen: str = "127.0.0.1:7470"
    http: str = "127.0.0.1:7471"
    token: str | None = None
    tokens_file: str | None = None
    max_namespaces: int = 4
    max_frame: int = 64 << 20
    max_inflight: int = 8
    max_connections: int = 256
    lease_s: float = 10.0
    write_policy: str = "write_through"
    shm: bool = True
    drain_s: float = 4.0
    kv_events: str | None = None
    kv_events_replay: str | None = None
    disk_codec: str = "none"
    remote_codec: str = "none"
    remote: str | None = field(default=None, repr=False)
    remote_writes: str = "put"
    remote_timeout_s: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.host_bytes < 0:
            object.__setattr__(self, "host_bytes", default_host_bytes())
        if self.disk_bytes < 0:
            object.__setattr__(self, "disk_bytes", default_disk_bytes(self.data_dir))
        if self.socket_path is None:
            object.__setattr__(self, "socket_path", str(self.data_dir / "kvstore.sock"))
        for name in ("max_namespaces", "max_frame", "max_inflight", "max_connections"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.max_frame < 4096:
            raise ConfigError(f"max_frame must be at least 4096 bytes, got {self.max_frame}")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(f"write_policy must be one of {list(WRITE_POLICIES)}, got {self.write_policy!r}")
        for name in ("disk_codec", "remote_codec"):
            if getattr(self, name) not in CODECS:
                raise ConfigError(f"{name} must be one of {list(CODECS)}, got {getattr(self, name)!r}")
        if not self.lease_s > 0 or not self.drain_s >= 0:
            raise ConfigError(f"lease_s must be > 0 and drain_s >= 0, got {self.lease_s}, {self.drain_s}")
        if self.host_bytes < 4096 * self.max_namespaces:
            raise ConfigError(f"host_bytes={self.host_bytes} leaves no slot for {self.max_namespaces} namespaces "
                              "(every put lands in host RAM; leave it out for a tenth of RAM)")
        if self.kv_events:
            from kvstore.events.config import EventsConfig

            try:
                EventsConfig(self.kv_events, self.kv_events_replay)
            except ConfigError as exc:
                raise ConfigError(f"--kv-events: {exc}") from None
        if self.remote is not None:
            from tiers.remote.url import parse_url

            try:
                parse_url(self.remote)
            except ValueError as exc:
                raise ConfigError(f"--remote: {exc}") from None
        if not isinstance(self.remote_timeout_s, (int, float)) or not self.remote_timeout_s > 0:
            raise ConfigError(f"remote_timeout_s must be positive, got {self.remote_timeout_s!r}")
        if self.remote_writes not in ("put", "demote"):
            raise ConfigError(f"remote_writes must be 'put' or 'demote', got {self.remote_writes!r}")
        for name in ("listen", "http"):
            addr = getattr(self, name)
            if addr:
                host, _port = parse_hostport(addr)
                if not is_loopback(host) and not (self.token or self.tokens_file):
                    raise ConfigError(f"--{name} {addr} is off loopback: a token is required "
                                      "(--token, KVSTORE_TOKEN or a tokens file)")

    @property
    def host_bytes_per_namespace(self) -> int:
        return self.host_bytes // self.max_namespaces

    @property
    def disk_bytes_per_namespace(self) -> int:
        return self.disk_bytes // self.max_namespaces


def load_config(path: str | os.PathLike[str] | None, overrides: dict[str, Any]) -> DaemonConfig:
    """Read a TOML file (keys are DaemonConfig field names), then apply non-None overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
    known = {f.name for f in fields(DaemonConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown config keys in {path}: {unknown}; known: {sorted(known)}")
    values.update({k: v for k, v in overrides.items() if v is not None})
    for name in ("host_bytes", "disk_bytes"):
        if name in values:
            values[name] = parse_size(values[name])
    return DaemonConfig(**values)
