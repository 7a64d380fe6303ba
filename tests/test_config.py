"""StoreSettings, the store knobs without a model: the checks it shares with StoreConfig, the
round trip through ``store_config``, and the one flag group ``kvstore serve`` and
``kvstore engine`` build from it."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import StoreConfig, StoreSettings
from kvstore.cli import main
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout
from kvstore.services.common.store_args import (
    GROUP_TITLE,
    STORE_FLAGS,
    add_store_arguments,
    store_settings_from_args,
)

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = KVLayout(2, 2, 16, 4, torch.float32)  # 2 KiB blocks, 4 KiB slots
SECRET = "pw-7731"
URL = f"redis://user:{SECRET}@127.0.0.1:6379"


@pytest.mark.parametrize(("knobs", "message"), [
    ({"disk_codec": "zstd"}, r"disk_codec must be one of \['none', 'int8', 'int8-fp32', 'fp8', 'int4-rot', 'int4-norot', 'auto'\], got 'zstd'"),
    ({"host_codec": "gzip"}, r"host_codec must be one of .*got 'gzip'"),
    ({"write_policy": "write_around"}, r"write_policy must be one of \['write_back', 'write_through'\]"),
    ({"promotion": "always"}, r"promotion must be one of \['get', 'lookup', 'never'\]"),
    ({"disk_admission": "seen_once"}, r"disk_admission must be one of \['all', 'seen_twice', 'tinylfu'\]"),
    ({"remote_admission": "some"}, r"remote_admission must be one of \['all', 'seen_twice', 'tinylfu'\]"),
    ({"remote_writes": "evict"}, r"remote_writes must be one of \['put', 'demote'\]"),
    ({"hash_algo": "md5"}, r"hash_algo must be one of .*got 'md5'"),
    ({"host_bytes": -1}, r"host_bytes must be an int of bytes >= 0, got -1"),
    ({"disk_bytes": True}, r"disk_bytes must be an int of bytes >= 0, got True"),
    ({"disk_path": ""}, r"disk_path must be a directory path or None"),
    ({"host_codec": "int8", "disk_path": "/tmp/kv", "disk_bytes": 1 << 20}, "would store decoded values"),
    ({"remote_url": URL, "remote_timeout_s": 0}, r"remote_timeout_s must be a positive number of seconds, got 0"),
    ({"remote_url": URL, "remote_queue_blocks": 0}, r"remote_queue_blocks must be an int >= 1, got 0"),
    ({"remote_url": URL, "remote_prefix": "a b"}, "remote key prefix must be printable ASCII"),
])
def test_a_bad_setting_is_refused_alike_with_and_without_a_layout(knobs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as without_layout:
        StoreSettings(**knobs)
    with pytest.raises(ConfigError, match=message) as with_layout:
        StoreConfig(layout=LAYOUT, **knobs)
    assert str(without_layout.value) == str(with_layout.value)  # one check, not two copies of it
    assert SECRET not in str(without_layout.value)


@pytest.mark.parametrize("url", [f"http://user:{SECRET}@127.0.0.1:1", f"redis://user:{SECRET}@127.0.0.1:port",
                                 f"redis+cluster://user:{SECRET}@"])
def test_a_bad_remote_url_is_refused_without_showing_its_password(url: str) -> None:
    with pytest.raises(ConfigError, match="remote URL") as info:
        StoreSettings(remote_url=url)
    assert SECRET not in str(info.value)


def test_the_remote_url_is_never_shown() -> None:
    settings = StoreSettings(remote_url=URL, remote_codec="int8")
    config = settings.store_config(LAYOUT, "m")
    for text in (repr(settings), str(settings), settings.describe(), repr(config)):
        assert SECRET not in text and "127.0.0.1" not in text
    assert "a remote tier int8" in settings.describe()


def test_store_config_round_trips_every_setting(tmp_path: Path) -> None:
    settings = StoreSettings(host_bytes=1 << 20, disk_path=str(tmp_path / "kv"), disk_bytes=2 << 20,
                             write_policy="write_through", disk_admission="seen_twice", remote_admission="tinylfu",
                             promotion="lookup",
                             host_codec="int8", disk_codec="fp8", remote_codec="int8-fp32", remote_url=URL,
                             remote_writes="demote", remote_timeout_s=2.5, remote_queue_blocks=9,
                             remote_prefix="blue", hash_algo="xxh3_128", cold_blocks="demote")
    assert settings.disk_path == tmp_path / "kv"  # a Path, as StoreConfig keeps it
    assert settings.changed_from() == list(StoreSettings.names())  # every field is set off its default
    config = settings.store_config(LAYOUT, "m", transfer_threads=3, pin_host_memory=False)
    assert (config.layout, config.model_id, config.transfer_threads, config.pin_host_memory) == (LAYOUT, "m", 3, False)
    assert config.settings == settings
    assert config.settings.store_config(LAYOUT, "m", transfer_threads=3, pin_host_memory=False) == config


def test_a_flat_store_config_gives_its_settings_back(tmp_path: Path) -> None:
    config = StoreConfig(layout=LAYOUT, model_id="m", host_bytes=1 << 20, disk_path=tmp_path, disk_bytes=1 << 20,
                         disk_codec="int8", promotion="never", shared_host=True)
    assert config.settings == StoreSettings(host_bytes=1 << 20, disk_path=tmp_path, disk_bytes=1 << 20,
                                            disk_codec="int8", promotion="never")
    assert config.settings.changed_from() == ["host_bytes", "disk_path", "disk_bytes", "promotion", "disk_codec"]


def test_no_setting_is_declared_twice() -> None:
    defaults, config = StoreSettings(), StoreConfig(layout=LAYOUT)
    assert defaults == config.settings
    # StoreConfig holds the settings, it does not repeat them: no field in both, none read twice
    assert not {f.name for f in fields(StoreConfig)} & set(StoreSettings.names())
    assert not any(hasattr(config, name) for name in StoreSettings.names())


def test_a_store_config_refuses_an_unknown_knob() -> None:
    with pytest.raises(ConfigError, match=r"unknown knobs \['host_byte'\]"):
        StoreConfig(LAYOUT, host_byte=1 << 20)


def test_what_needs_a_layout_is_checked_by_store_config() -> None:
    small = StoreSettings(host_bytes=100)  # fine without a layout
    with pytest.raises(ConfigError, match=r"host_bytes=100 is smaller than one block slot \(4096"):
        small.store_config(LAYOUT)
    through = StoreSettings(write_policy="write_through")
    with pytest.raises(ConfigError, match="write_policy='write_through' needs a disk tier"):
        through.store_config(LAYOUT)


def test_store_config_refuses_a_setting_as_an_extra() -> None:
    with pytest.raises(ConfigError, match=r"\['host_bytes'\] are store settings: pass dataclasses.replace"):
        StoreSettings().store_config(LAYOUT, "m", host_bytes=1 << 20)


# --------------------------------------------------------------------------- the flag group


def test_flags_given_override_the_base_and_only_those() -> None:
    parser = argparse.ArgumentParser()
    add_store_arguments(parser, defaults=StoreSettings())
    base = StoreSettings(host_bytes=4 << 20, promotion="never")
    args = parser.parse_args(["--disk-path", "/tmp/kv", "--disk-size", "2GiB", "--disk-codec", "int8",
                              "--remote-url", URL, "--remote-timeout", "1.5", "--hash-algo", "xxh3_128"])
    settings = store_settings_from_args(args, base)
    assert settings == StoreSettings(host_bytes=4 << 20, promotion="never", disk_path="/tmp/kv",
                                     disk_bytes=2 << 30, disk_codec="int8", remote_url=URL,
                                     remote_timeout_s=1.5, hash_algo="xxh3_128")
    assert store_settings_from_args(parser.parse_args([]), base) == base


def store_groups(command: str) -> dict[str, list[str]]:
    """``kvstore COMMAND --help``'s flags per argument group (a real process)."""
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", command, "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"COLUMNS": "100", "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    groups: dict[str, list[str]] = {}
    current = None
    for line in proc.stdout.splitlines():
        if re.fullmatch(r"[a-z][a-z ]*:", line):
            current = groups.setdefault(line[:-1], [])
        elif current is not None and (match := re.match(r"  (--[a-z0-9-]+)(?=[ ,]|$)", line)):
            current.append(match.group(1))
    return groups


def test_serve_and_engine_list_the_same_store_flags_in_one_group() -> None:
    serve, engine = store_groups("serve"), store_groups("engine")
    every = [spec.flag for spec in STORE_FLAGS.values()]
    assert engine[GROUP_TITLE] == every
    daemon_decides = ["--disk-path", "--host-codec", "--hash-algo"]  # named in the group's description
    assert serve[GROUP_TITLE] == [flag for flag in every if flag not in daemon_decides]
    for groups in (serve, engine):  # no store flag anywhere else, no old spelling left
        others = [flag for title, flags in groups.items() if title != GROUP_TITLE for flag in flags]
        assert not set(others) & set(every)
        assert not {"--disk", "--remote"} & set(others)


def test_engine_refuses_store_flags_next_to_a_daemon_and_a_size_without_its_path(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["engine", "--random-model", "--store-url", "unix:///tmp/nothing.sock", "--disk-codec", "int8",
                 "--promotion", "never"])
    err = capsys.readouterr().err
    assert code == 2 and "--promotion, --disk-codec set the embedded store; with --store-url the daemon's" in err
    assert main(["engine", "--random-model", "--disk-size", "1GiB"]) == 2
    assert "--disk-size sizes the disk tier of --disk-path DIR" in capsys.readouterr().err
    # --store, the old spelling of --store-url, still names the daemon, and says so
    assert main(["engine", "--random-model", "--store", "unix:///tmp/nothing.sock", "--promotion", "never"]) == 2
    err = capsys.readouterr().err
    assert "--store is spelled --store-url now" in err and "--promotion set the embedded store; with --store-url" in err


@pytest.mark.parametrize("command", ["serve", "engine"])
def test_a_bad_remote_url_flag_is_a_usage_error_without_the_password(command: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = ["--random-model"] if command == "engine" else []
    with pytest.raises(SystemExit) as info:
        main([command, *model, "--remote-url", f"http://user:{SECRET}@127.0.0.1:1"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "argument --remote-url:" in err and "remote URL" in err
    assert SECRET not in err
