"""The daemon's TOML config (``kvstore serve --config FILE``): ``load_config(path, {})``
(kvstore/services/daemon/config.py), its own keys, the store settings it takes, sizes,
addresses and ``[quotas.TENANT]`` tables.

Input: the whole file. The harness writes it to one temporary path and loads it with no flag
given, as the daemon does (host and disk sizes left out are taken from the machine). Nothing
is created or bound: a config is only read and checked. What must hold:

- a file it refuses is a ConfigError (never a TOML or Unicode error, a KeyError, TypeError,
  AttributeError, an OSError of the data directory's probe, ...);
- a config it accepts, written back as TOML (every key it has, sizes in bytes, quotas as
  their ``as_dict``), loads again as the same config.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from kvstore.config import StoreSettings
from kvstore.errors import ConfigError
from kvstore.policy.quotas import QuotaTable
from kvstore.services.daemon.config import FIXED_SETTINGS, DaemonConfig, load_config


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string (quotes, backslashes and control characters escaped)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif (ch < " " and ch != "\t") or ch == "\x7f":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return toml_string(str(value))
    assert isinstance(value, dict), value
    return "{ " + ", ".join(f"{toml_string(str(k))} = {toml_value(v)}" for k, v in value.items()) + " }"


def written_back(config: DaemonConfig) -> str:
    """``config`` as a TOML file ``load_config`` reads."""
    values: dict[str, Any] = {f.name: getattr(config, f.name) for f in fields(DaemonConfig)
                              if f.name not in ("store_settings", "quotas")}
    values.update({name: getattr(config.store_settings, name) for name in StoreSettings.names()
                   if name not in FIXED_SETTINGS})
    lines = [f"{name} = {toml_value(value)}" for name, value in values.items() if value is not None]
    if config.quotas.tenants:
        lines.append(f"quotas = {toml_value(config.quotas.as_dict())}")
    return "\n".join(lines) + "\n"


def make() -> Callable[[bytes], None]:
    root = Path(tempfile.mkdtemp(prefix="kvstore-fuzz-daemon-toml-"))
    atexit.register(shutil.rmtree, root, True)
    path, again_path = root / "kvstore.toml", root / "again.toml"

    def check(data: bytes) -> None:
        path.write_bytes(data)
        try:
            config = load_config(path, {})
        except ConfigError:
            return
        text = written_back(config)
        again_path.write_text(text, encoding="utf-8")
        try:
            again = load_config(again_path, {})
        except ConfigError as exc:
            raise AssertionError(f"the config written back is refused: {exc}\n{text}") from None
        # quotas compare as shown: a share is written back to six significant digits
        assert replace(again, quotas=QuotaTable()) == replace(config, quotas=QuotaTable()), text
        assert again.quotas.as_dict() == config.quotas.as_dict(), text

    return check


def seeds() -> dict[str, bytes]:
    """The tests' configs (every type of key), store settings, quotas, and a daemon exposed
    off loopback with a token."""
    return {
        "types": b'data_dir = "/tmp/kvstore-fuzz-data"\nhost_bytes = "64MiB"\ndisk_bytes = 0\nlease_s = 3\n'
                 b'shm = false\nmax_namespaces = 2\ntoken = "s3cret"\nkv_events_replay = ""\n',
        "store-settings": b'remote_url = "redis://:pw-9931@127.0.0.1:6379"\nremote_timeout_s = 2\n'
                          b'remote_writes = "demote"\npromotion = "lookup"\ndisk_admission = "seen_twice"\n'
                          b'remote_prefix = "blue"\nwrite_policy = "write_back"\nhost_bytes = "4MiB"\n'
                          b'disk_bytes = "8MiB"\n',
        "quotas": b'host_bytes = "1GiB"\ndisk_bytes = "20GiB"\ndefault_quotas = "none"\n'
                  b'tokens_file = "/etc/kvstore/tokens.toml"\n\n'
                  b'[quotas.acme]\nhost = { soft = "40%", hard = "2GiB" }\ndisk = { soft = "25%" }\n\n'
                  b'[quotas.flood]\n"*" = { soft = 0.25 }\n',
        "exposed": b'listen = "0.0.0.0:7470"\nhttp = "[::1]:7471"\nsocket_path = ""\ntoken = "tok-admin"\n'
                   b'max_frame = 16384\nmax_inflight = 4\nmax_connections = 64\ndrain_s = 0.5\n'
                   b'kv_events = "tcp://127.0.0.1:5557"\nhost_bytes = 67108864\ndisk_bytes = 0\n',
    }
