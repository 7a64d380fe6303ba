"""DaemonConfig: every knob of ``kvstore serve``, from flags and an optional TOML file."""

from __future__ import annotations

import ipaddress
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

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


MAX_SIZE = (1 << 63) - 1  # bytes: the largest file offset
MAX_SOCKET_PATH = 107  # bytes: sun_path is 108, the last one for the NUL every C client writes


def parse_size(text: str | int) -> int:
    """``"512MiB"`` -> 536870912; plain ints pass through. ConfigError for anything else, and
    for a size below 0 or above MAX_SIZE."""
    if isinstance(text, int) and not isinstance(text, bool):
        size: float = text
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"size {text!r} is not a number with an optional unit like 512MiB or 20GiB")
        size = float(match.group(1)) * _UNITS[match.group(2).lower()]  # inf past ~1e308
    if not 0 <= size <= MAX_SIZE:
        shown = str(text) if len(str(text)) <= 40 else f"{str(text)[:16]}... ({len(str(text))} characters)"
        raise ConfigError(f"size {shown} is out of range: 0 to {MAX_SIZE} bytes")
    return int(size)


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
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
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
            from kvstore.tiers.remote.url import parse_url

            try:
                parse_url(self.remote)
            except ValueError as exc:
                raise ConfigError(f"--remote: {exc}") from None
        if not isinstance(self.remote_timeout_s, (int, float)) or not self.remote_timeout_s > 0:
            raise ConfigError(f"remote_timeout_s must be positive, got {self.remote_timeout_s!r}")
        if self.remote_writes not in ("put", "demote"):
            raise ConfigError(f"remote_writes must be 'put' or 'demote', got {self.remote_writes!r}")
        if not (self.socket_path or self.listen or self.http):
            raise ConfigError("--socket, --listen and --http are all off: the daemon would serve nothing")
        if self.socket_path and len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise ConfigError(f"--socket {self.socket_path} is {len(os.fsencode(self.socket_path))} bytes long; "
                              f"a Unix socket path has at most {MAX_SOCKET_PATH} (give a shorter --socket)")
        exposed = self.off_loopback()
        if exposed and not (self.token or self.tokens_file):
            raise ConfigError(f"{exposed[0]} is off loopback: a token is required "
                              "(--token, KVSTORE_TOKEN or a tokens file)")

    def off_loopback(self) -> list[str]:
        """``--listen``/``--http`` addresses off loopback, as ``"--listen HOST:PORT"``: each
        needs a token (the daemon checks its loaded tokens too: a tokens file may hold none)."""
        out = []
        for name in ("listen", "http"):
            addr = getattr(self, name)
            if addr and not is_loopback(parse_hostport(addr)[0]):
                out.append(f"--{name} {addr}")
        return out

    @property
    def host_bytes_per_namespace(self) -> int:
        return self.host_bytes // self.max_namespaces

    @property
    def disk_bytes_per_namespace(self) -> int:
        return self.disk_bytes // self.max_namespaces


SIZE_FIELDS = ("host_bytes", "disk_bytes")
SECRET_FIELDS = ("token", "remote")  # errors show their type, never their value
EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a path (a string)"}


def check_types(values: dict[str, Any], source: str) -> None:
    """ConfigError naming the key, ``source`` and the expected type for a value whose type
    is not its DaemonConfig field's: bools are not numbers, numbers are finite, a path is a
    string, a size an integer of bytes or a string with a unit (TOML has no null, so an
    optional field takes its other type)."""
    hints = get_type_hints(DaemonConfig)
    for name, value in values.items():
        if name in SIZE_FIELDS:
            if not isinstance(value, (int, str)) or isinstance(value, bool):
                raise ConfigError(f"{name} in {source} must be a size (bytes, or a string like \"512MiB\"), "
                                  f"got {value!r}")
            continue
        kinds = [t for t in get_args(hints[name]) or (hints[name],) if t is not type(None)]
        if not any(_is_a(kind, value) for kind in kinds):
            expected = " or ".join(EXPECTED[kind] for kind in kinds)
            got = f"a {type(value).__name__}" if name in SECRET_FIELDS else repr(value)
            raise ConfigError(f"{name} in {source} must be {expected}, got {got}")


def _is_a(kind: type, value: Any) -> bool:
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, str if kind is Path else kind)


def load_config(path: str | os.PathLike[str] | None, overrides: dict[str, Any]) -> DaemonConfig:
    """Read a TOML file (keys are DaemonConfig field names), then apply non-None overrides.

    Raises:
        ConfigError: the file cannot be read, has an unknown key or a value of the wrong type
            (naming the key, the file and the type), or a setting is invalid.
    """
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
        check_types(values, str(path))
    given = {k: v for k, v in overrides.items() if v is not None}
    values.update(given)
    for name in SIZE_FIELDS:
        if name in values:
            try:
                values[name] = parse_size(values[name])
            except ConfigError as exc:
                if name in given:
                    raise
                raise ConfigError(f"{name} in {path}: {exc}") from None
    return DaemonConfig(**values)
