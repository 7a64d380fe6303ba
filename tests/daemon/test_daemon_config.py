"""The daemon's settings: TOML values of the wrong type, sizes out of range, tokens files that
define no token, settings that would serve nothing. Each is a ConfigError naming what to fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvstore.config import StoreSettings
from kvstore.errors import ConfigError
from kvstore.services.common.sizes import MAX_SIZE, format_size, parse_size
from kvstore.services.common.tokens import Principal, Tokens
from kvstore.services.daemon.config import DaemonConfig, load_config

HOST_ONLY = StoreSettings(host_bytes=1 << 20, disk_bytes=0)


@pytest.mark.parametrize(("line", "message"), [
    ('lease_s = "abc"', "lease_s in {file} must be a number, got 'abc'"),
    ("drain_s = inf", "drain_s in {file} must be a number, got inf"),
    ("remote_timeout_s = true", "remote_timeout_s in {file} must be a number, got True"),
    ("data_dir = 5", r"data_dir in {file} must be a path \(a string\), got 5"),
    ("token = 123", "token in {file} must be a string, got a int"),  # a secret: its type only
    ('shm = "no"', "shm in {file} must be true or false, got 'no'"),
    ("max_namespaces = true", "max_namespaces in {file} must be an integer, got True"),
    ("max_frame = 65536.0", "max_frame in {file} must be an integer, got 65536.0"),
    ("listen = 7470", "listen in {file} must be a string, got 7470"),
    ("host_bytes = true", r"host_bytes in {file} must be a size \(bytes, or a string like \"512MiB\"\), got True"),
    ("host_bytes = -5", "host_bytes in {file}: size -5 is out of range: 0 to 9223372036854775807 bytes"),
    (f'disk_bytes = "{"9" * 400}"', r"disk_bytes in {file}: size 9999999999999999\.\.\. \(400 characters\) is out of range"),
    ('disk_bytes = "20 parsecs"', "disk_bytes in {file}: size '20 parsecs' is not a number with an optional unit"),
])
def test_a_toml_value_of_the_wrong_type_names_key_file_and_type(tmp_path: Path, line: str, message: str) -> None:
    toml = tmp_path / "kvstore.toml"
    toml.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message.format(file=re.escape(str(toml)))) as info:
        load_config(toml, {"data_dir": tmp_path / "data"})
    if line.startswith("token"):  # the secret is not shown (the file's path may hold any digits: pytest-123)
        assert "123" not in str(info.value).replace(str(toml), "")


def test_toml_values_of_the_right_type_load(tmp_path: Path) -> None:
    toml = tmp_path / "kvstore.toml"
    toml.write_text(f'data_dir = "{tmp_path / "data"}"\nhost_bytes = "64MiB"\ndisk_bytes = 0\nlease_s = 3\n'
                    'shm = false\nmax_namespaces = 2\ntoken = "s3cret"\nkv_events_replay = ""\n')
    cfg = load_config(toml, {})
    assert (cfg.data_dir, cfg.store_settings.host_bytes, cfg.store_settings.disk_bytes) == (tmp_path / "data", 64 << 20, 0)
    assert (cfg.lease_s, cfg.shm, cfg.max_namespaces, cfg.token) == (3, False, 2, "s3cret")
    assert cfg.store_settings.write_policy == "write_through"  # the daemon's default: an acknowledged put is durable
    assert load_config(toml, {"host_bytes": "1MiB"}).store_settings.host_bytes == 1 << 20  # flags win


def test_toml_store_keys_are_the_store_settings_names(tmp_path: Path) -> None:
    toml = tmp_path / "kvstore.toml"
    toml.write_text('remote_url = "redis://:pw-9931@127.0.0.1:6379"\nremote_timeout_s = 2\n'
                    'remote_writes = "demote"\npromotion = "lookup"\ndisk_admission = "seen_twice"\n'
                    'remote_prefix = "blue"\nwrite_policy = "write_back"\n')
    cfg = load_config(toml, {"data_dir": tmp_path / "data", "host_bytes": "4MiB", "disk_bytes": "8MiB"})
    assert cfg.store_settings == StoreSettings(host_bytes=4 << 20, disk_bytes=8 << 20, write_policy="write_back",
                                      promotion="lookup", disk_admission="seen_twice",
                                      remote_url="redis://:pw-9931@127.0.0.1:6379", remote_writes="demote",
                                      remote_timeout_s=2, remote_prefix="blue")
    assert "pw-9931" not in repr(cfg)


def test_the_old_remote_key_is_refused_naming_remote_url(tmp_path: Path) -> None:
    toml = tmp_path / "kvstore.toml"
    toml.write_text('remote = "redis://:pw-9931@127.0.0.1:6379"\n')
    with pytest.raises(ConfigError, match=r"config key 'remote' in .* is now 'remote_url'") as info:
        load_config(toml, {"data_dir": tmp_path / "data"})
    assert "pw-9931" not in str(info.value)


@pytest.mark.parametrize(("line", "why"), [
    ('disk_path = "/tmp/x"', "disk tier under data_dir"),
    ('host_codec = "int8"', "host tier stays raw"),
    ('hash_algo = "xxh3_128"', "each client chooses"),
])
def test_store_settings_the_daemon_decides_itself_are_refused_with_the_reason(tmp_path: Path, line: str,
                                                                              why: str) -> None:
    toml = tmp_path / "kvstore.toml"
    toml.write_text(line + "\n")
    name = line.split()[0]
    with pytest.raises(ConfigError, match=f"{name} in .* is not a daemon setting: .*{why}"):
        load_config(toml, {"data_dir": tmp_path / "data"})
    with pytest.raises(ConfigError, match=f"{name} is not a daemon setting"):  # built directly, too
        DaemonConfig(data_dir=tmp_path, store_settings=StoreSettings(**{name: line.split('"')[1]}))


def test_parse_size_bounds() -> None:
    assert parse_size("1.5KiB") == 1536 and parse_size(0) == 0 and parse_size(MAX_SIZE) == MAX_SIZE
    for size in (1 << 30, 10 << 30, 1536, 4097, 0):
        assert parse_size(format_size(size)) == size
    assert (format_size(1 << 30), format_size(1536), format_size(4097)) == ("1GiB", "1536", "4097")
    for bad in ("9" * 400, -1, MAX_SIZE + 1, "9000000TiB"):
        with pytest.raises(ConfigError, match="out of range"):
            parse_size(bad)
    with pytest.raises(ConfigError, match="not a number"):
        parse_size(True)


def test_max_namespaces_true_is_not_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_namespaces must be a positive int, got True"):
        DaemonConfig(data_dir=tmp_path, store_settings=HOST_ONLY, max_namespaces=True)


def test_a_daemon_that_would_serve_nothing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--socket, --listen and --http are all off"):
        DaemonConfig(data_dir=tmp_path, store_settings=HOST_ONLY, socket_path="", listen="", http="")
    assert DaemonConfig(data_dir=tmp_path, store_settings=HOST_ONLY, listen="", http="").socket_path


def test_a_socket_path_too_long_for_sun_path_is_refused_with_its_length(tmp_path: Path) -> None:
    path = "/tmp/" + "x" * 103  # 108 bytes: Python would bind it, but no NUL fits after it
    with pytest.raises(ConfigError, match=r"is 108 bytes long; a Unix socket path has at most 107"):
        DaemonConfig(data_dir=tmp_path, store_settings=HOST_ONLY, socket_path=path)
    assert DaemonConfig(data_dir=tmp_path, store_settings=HOST_ONLY, socket_path=path[:-1]).socket_path


# --------------------------------------------------------------------------- tokens files

GOOD = '[[tenant]]\nname = "acme"\ntokens = ["tok-acme", "tok-acme-2"]\n\n' \
       '[[tenant]]\nname = "beta"\ntokens = ["tok-beta"]\nshm = false\n'


@pytest.mark.parametrize(("text", "message"), [
    ("", "defines no token"),
    ("# no tenants yet\n", "defines no token"),
    ("tenant = []\n", "defines no token"),
    ("tokens = []\n", r"unknown keys \['tokens'\]"),
    ('[[tenants]]\nname = "a"\ntokens = ["t"]\n', r"unknown keys \['tenants'\]"),
    ('admin_token = "x"\n', r"unknown keys \['admin_token'\]"),
    ('tenant = "x"\n', r"'tenant' must be an array of tables \(\[\[tenant\]\]\), got str"),
    ("tenant = [1, 2]\n", r"'tenant' must be an array of tables"),
    ('[tenant]\nname = "a"\ntokens = ["t"]\n', r"'tenant' must be an array of tables .*got dict"),
    ('[[tenant]]\nname = "a"\n', r'tenant #0 needs name = "\.\.\." and tokens = \["\.\.\."\]'),
    ('[[tenant]]\nname = "a"\ntokens = []\n', "tenant #0 needs"),
    ('[[tenant]]\nname = "a"\ntokens = "t"\n', "tenant #0 needs"),
    ('[[tenant]]\nname = "a"\ntokens = [""]\n', "tenant #0 needs"),
    ('[[tenant]]\nname = ""\ntokens = ["t"]\n', "tenant #0 needs"),
    ('[[tenant]]\ntokens = ["t"]\n', "tenant #0 needs"),
    ('[[tenant]]\nname = "a"\ntoken = ["t"]\n', r"tenant #0 has unknown keys \['token'\]"),
    ('[[tenant]]\nname = "a"\ntokens = ["t"]\nshm = "no"\n', r"tenant #0 \(a\): shm must be true or false"),
    ('[[tenant]]\nname = "a"\ntokens = ["t"]\n[[tenant]]\nname = "b"\ntokens = ["t"]\n',
     "a token of tenant 'b' is also one of 'a'"),
    ("[[tenant\n", "cannot read tokens file"),
])
def test_a_tokens_file_that_is_malformed_or_defines_no_token_is_refused(tmp_path: Path, text: str,
                                                                          message: str) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        Tokens(None, str(path))
    assert str(path) in str(info.value)
    with pytest.raises(ConfigError, match=message):
        Tokens("tok-admin", str(path))  # an admin token does not make a broken file fine


def test_a_good_tokens_file_maps_tokens_to_tenants(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(GOOD)
    tokens = Tokens(None, str(path))
    assert not tokens.is_open and not tokens.has_admin
    assert tokens.authenticate("tok-acme-2") == Principal("acme")
    assert tokens.authenticate("tok-beta") == Principal("beta", shm=False)
    assert Tokens(None, None).is_open and Tokens(None, None).authenticate(None) == Principal("")


# ------------------------------------------------------------------------- fuzz regressions
# Found by the daemon_toml and tokens_file fuzz harnesses (fuzz/regressions/daemon_toml/,
# fuzz/regressions/tokens_file/): each escaped as another error than ConfigError.


@pytest.mark.parametrize("content", [
    b'listen = "127.0.0.1:7470\xff"\n',  # tomllib decodes the bytes itself: UnicodeDecodeError
    b"host_bytes = " + b"[" * 600 + b"]" * 600 + b"\n",  # and nests by recursion: RecursionError
])
def test_a_file_that_is_not_toml_is_a_config_error(tmp_path: Path, content: bytes) -> None:
    toml = tmp_path / "kvstore.toml"
    toml.write_bytes(content)
    with pytest.raises(ConfigError, match=f"cannot read config {re.escape(str(toml))}: "):
        load_config(toml, {"data_dir": tmp_path / "data"})
    with pytest.raises(ConfigError, match=f"cannot read tokens file {re.escape(str(toml))}: "):
        Tokens(None, str(toml))


@pytest.mark.parametrize(("line", "message"), [
    ('listen = "127.0.0.1:²"', "address '127.0.0.1:²' is not HOST:PORT"),  # "²".isdigit(): int() raised
    ('socket_path = "/tmp/k\\u0000.sock"', "socket_path holds a NUL character"),
    ('tokens_file = "/etc/\\u0000"', "tokens_file holds a NUL character"),
])
def test_an_address_or_path_no_socket_can_take_is_a_config_error(tmp_path: Path, line: str, message: str) -> None:
    toml = tmp_path / "kvstore.toml"
    toml.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        load_config(toml, {"data_dir": tmp_path / "data", "host_bytes": "64MiB", "disk_bytes": 0})


@pytest.mark.parametrize(("data_dir", "message"), [
    ("d" * 300, "File name too long"),  # OSError from the probe of its file system
    ("/tmp/d\\u0000", "embedded null byte"),  # ValueError
])
def test_a_data_dir_whose_file_system_cannot_be_sized_is_a_config_error(tmp_path: Path, data_dir: str,
                                                                        message: str) -> None:
    toml = tmp_path / "kvstore.toml"
    toml.write_text(f'data_dir = "{data_dir}"\nhost_bytes = "64MiB"\n')
    with pytest.raises(ConfigError, match=f"data_dir .*: its file system cannot be sized .*{message}.*give disk_bytes"):
        load_config(toml, {})
    toml.write_text(f'data_dir = "{data_dir}"\nhost_bytes = "64MiB"\ndisk_bytes = 0\n')
    with pytest.raises(ConfigError, match="holds a NUL character" if "u0000" in data_dir else "sun_path|at most 107"):
        load_config(toml, {})
