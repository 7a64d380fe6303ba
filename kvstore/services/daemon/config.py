"""DaemonConfig: every knob of ``kvstore serve``, from flags and an optional TOML file.

The store knobs are one StoreSettings (``store_settings``; TOML keys are its field names, as for every
service); the rest is the daemon's own: addresses, tokens, limits, the namespace split, and
tenants' quotas (``default_quotas``, and ``[quotas.TENANT]`` tables: kvstore/policy/quotas.py).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, get_args, get_type_hints

from kvstore.config import StoreSettings
from kvstore.errors import ConfigError
from kvstore.policy.quotas import QuotaTable
from kvstore.services.common.net import is_loopback, parse_hostport
from kvstore.services.common.sizes import parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MAX_SOCKET_PATH = 107  # bytes: sun_path is 108, the last one for the NUL every C client writes
# A daemon's put is acknowledged once durable: write_through whenever a namespace has a disk tier.
DEFAULT_STORE = StoreSettings(write_policy="write_through")
# Store settings the daemon decides itself, with the reason (a TOML key or flag for them is refused).
FIXED_SETTINGS = {
    "disk_path": ("the daemon keeps each namespace's disk tier under data_dir (set data_dir, "
                  "or --data-dir)"),
    "host_codec": "the daemon's host tier stays raw: clients put into and map its slots directly",
    "hash_algo": "each client chooses its namespace's key hash (hello's hash_algo)",
}
RENAMED = {"remote": "remote_url"}  # old TOML key -> its name now
DEFAULT_QUOTAS = ("equal", "none")


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
        store_settings: the store settings every namespace's store is built from. ``host_bytes`` and
            ``disk_bytes`` are hard TOTALS: each of ``max_namespaces`` namespace slots gets an
            equal share (disk_bytes=0: no disk tier; host RAM cannot be 0, every put lands
            there). ``write_policy`` (default write_through: an acknowledged put is durable)
            applies where a namespace has a disk tier. ``remote_url`` is a remote tier every
            namespace shares with other nodes (docs/remote.md): prefer the TOML key to the
            flag, which other users can see in ``ps``. ``disk_path``, ``host_codec`` and
            ``hash_algo`` are the daemon's own (FIXED_SETTINGS). ``load_config`` sizes host
            and disk from the machine when they are not given (``default_host_bytes``,
            ``default_disk_bytes``); DaemonConfig alone takes DEFAULT_STORE.
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
        shm: offer the shared-memory path to Unix-socket clients.
        drain_s: seconds SIGTERM waits for in-flight requests.
        kv_events: publish every namespace's tiers as KV events on this ZeroMQ endpoint
            (docs/kv-events.md); None: no events.
        kv_events_replay: the replay/snapshot socket; None: the next port, "": none.
        default_quotas: "equal": each tenant of the tokens file has an equal soft share of
            every tier (unless ``quotas`` or the tokens file says otherwise); "none": tenants
            have only the quotas given (none at all: one shared eviction order per tier).
        quotas: tenants' quotas (TOML ``[quotas.acme] host = {soft = "40%", hard = "2GiB"}``),
            over the tokens file's and the defaults; an admin REST call changes them at run time.
    """

    data_dir: Path = Path(".kvstore")
    store_settings: StoreSettings = DEFAULT_STORE
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
    shm: bool = True
    drain_s: float = 4.0
    kv_events: str | None = None
    kv_events_replay: str | None = None
    default_quotas: str = "equal"
    quotas: QuotaTable = field(default_factory=QuotaTable)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if not isinstance(self.store_settings, StoreSettings):
            raise ConfigError(f"store_settings must be a StoreSettings, got {type(self.store_settings).__name__}")
        for name, reason in FIXED_SETTINGS.items():
            if getattr(self.store_settings, name) != getattr(DEFAULT_STORE, name):
                raise ConfigError(f"{name} is not a daemon setting: {reason}")
        if self.socket_path is None:
            object.__setattr__(self, "socket_path", str(self.data_dir / "kvstore.sock"))
        for name in ("data_dir", "socket_path", "tokens_file"):
            if "\0" in str(getattr(self, name) or ""):
                raise ConfigError(f"{name} holds a NUL character: no path can")
        for name in ("max_namespaces", "max_frame", "max_inflight", "max_connections"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.max_frame < 4096:
            raise ConfigError(f"max_frame must be at least 4096 bytes, got {self.max_frame}")
        if self.default_quotas not in DEFAULT_QUOTAS:
            raise ConfigError(f"default_quotas must be one of {list(DEFAULT_QUOTAS)}, got {self.default_quotas!r}")
        if not isinstance(self.quotas, QuotaTable):
            raise ConfigError(f"quotas must be a QuotaTable, got {type(self.quotas).__name__}")
        if not self.lease_s > 0 or not self.drain_s >= 0:
            raise ConfigError(f"lease_s must be > 0 and drain_s >= 0, got {self.lease_s}, {self.drain_s}")
        if self.store_settings.host_bytes < 4096 * self.max_namespaces:
            raise ConfigError(f"host_bytes={self.store_settings.host_bytes} leaves no slot for {self.max_namespaces} "
                              "namespaces (every put lands in host RAM; leave it out for a tenth of RAM)")
        if self.kv_events:
            from kvstore.events.config import EventsConfig

            try:
                EventsConfig(self.kv_events, self.kv_events_replay)
            except ConfigError as exc:
                raise ConfigError(f"--kv-events: {exc}") from None
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
        return self.store_settings.host_bytes // self.max_namespaces

    @property
    def disk_bytes_per_namespace(self) -> int:
        return self.store_settings.disk_bytes // self.max_namespaces


SIZE_FIELDS = ("host_bytes", "disk_bytes")
SECRET_FIELDS = ("token", "remote_url")  # errors show their type, never their value
EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a path (a string)"}


def config_keys() -> list[str]:
    """Every key a daemon TOML file may hold: DaemonConfig's own fields and the store
    settings the daemon takes (all of StoreSettings but FIXED_SETTINGS)."""
    own = [f.name for f in fields(DaemonConfig) if f.name != "store_settings"]
    return own + [name for name in StoreSettings.names() if name not in FIXED_SETTINGS]


def check_types(values: dict[str, Any], source: str) -> None:
    """ConfigError naming the key, ``source`` and the expected type for a value whose type
    is not its field's (a DaemonConfig or StoreSettings field): bools are not numbers,
    numbers are finite, a path is a string, a size an integer of bytes or a string with a
    unit (TOML has no null, so an optional field takes its other type)."""
    hints = {**get_type_hints(StoreSettings), **get_type_hints(DaemonConfig)}
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
    """Read a TOML file, then apply the non-None ``overrides`` (flags). Keys of both are
    DaemonConfig field names and StoreSettings field names (``config_keys``); sizes may be
    text like "512MiB". ``host_bytes`` and ``disk_bytes`` given nowhere are sized from the
    machine (``default_host_bytes``, ``default_disk_bytes`` of the data directory).

    Raises:
        ConfigError: the file cannot be read, has an unknown or renamed key (naming the new
            one), a store setting the daemon decides itself, or a value of the wrong type
            (naming the key, the file and the type); or a setting is invalid.
    """
    values: dict[str, Any] = {}
    quotas: Any = None
    if path is not None:
        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except (OSError, UnicodeDecodeError, RecursionError, tomllib.TOMLDecodeError) as exc:
            # (tomllib decodes the bytes itself, and nests by recursion: not UTF-8, or too deep)
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        for old, new in RENAMED.items():
            if old in values:
                raise ConfigError(f"config key {old!r} in {path} is now {new!r}: rename it")
        for name, reason in FIXED_SETTINGS.items():
            if name in values:
                raise ConfigError(f"{name} in {path} is not a daemon setting: {reason}")
        quotas = values.pop("quotas", None)
        known = config_keys()
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown config keys in {path}: {unknown}; known: {sorted(known)}")
        check_types(values, str(path))
    given = {k: v for k, v in overrides.items() if v is not None}
    values.update(given)
    if quotas is not None:
        values["quotas"] = QuotaTable.from_dict(quotas, parse_size, where=f"{path}: quotas")
    for name in SIZE_FIELDS:
        if name in values:
            try:
                values[name] = parse_size(values[name])
            except ConfigError as exc:
                if name in given:
                    raise
                raise ConfigError(f"{name} in {path}: {exc}") from None
    settings = {name: values.pop(name) for name in StoreSettings.names() if name in values}
    if "host_bytes" not in settings:
        settings["host_bytes"] = default_host_bytes()
    if "disk_bytes" not in settings:
        data_dir = Path(values.get("data_dir", DaemonConfig.data_dir))
        try:
            settings["disk_bytes"] = default_disk_bytes(data_dir)
        except (OSError, ValueError) as exc:  # a name too long, a NUL character
            raise ConfigError(f"data_dir {str(data_dir)[:80]!r}: its file system cannot be sized "
                              f"({type(exc).__name__}: {str(exc)[:120]}); give disk_bytes") from None
    return DaemonConfig(store_settings=replace(DEFAULT_STORE, **settings), **values)
