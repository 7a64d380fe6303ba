"""Starting ``kvstore serve``: what it refuses (one line, exit status 2, nothing left behind),
what it never removes, and the socket's permissions from its creation. Failed starts run in
this process (``kvstore.cli.main``: the status the process would exit with); a daemon that
holds a data directory and a socket is a real process."""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.config import StoreSettings
from kvstore.errors import ConfigError
from kvstore.services.daemon.config import DaemonConfig
from kvstore.services.daemon.server import Daemon, _remove_stale_socket

from daemon_helpers import ROOT, DaemonProc, blocks, prompt

HOST_ONLY = StoreSettings(host_bytes=1 << 20, disk_bytes=0)
IN_ATTRIB, IN_CREATE = 0x4, 0x100


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """A live daemon whose namespace (and so its disk tier's lock) is open."""
    d = DaemonProc(tmp_path_factory.mktemp("holder") / "data")
    with d.connect() as client:
        keys = client.block_keys(prompt(1, 2))
        client.put(keys, blocks(keys))
    yield d
    d.stop()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory under /tmp with a short path (sun_path is 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def serve(capsys: pytest.CaptureFixture[str], data_dir: Path, *args: str) -> tuple[int, str]:
    """``kvstore serve`` in this process for a start that fails: (exit status, stderr)."""
    capsys.readouterr()
    code = main(["serve", "--data-dir", str(data_dir), "--host-mem", "1MiB", "--disk-size", "0",
                 "--listen", "", "--http", "", *args])
    return code, capsys.readouterr().err


def assert_one_line(err: str, *fragments: str) -> None:
    assert err.startswith("kvstore serve: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


def test_a_socket_path_that_is_a_file_or_a_directory_is_refused_and_kept(tmp_path: Path, short_dir: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    victim = short_dir / "victim.txt"
    victim.write_text("precious\n")
    with pytest.raises(ConfigError, match="exists and is not a socket"):
        _remove_stale_socket(victim)
    code, err = serve(capsys, tmp_path / "data", "--socket", str(victim))
    assert code == 2
    assert_one_line(err, f"--socket {victim} exists and is not a socket")
    assert victim.read_text() == "precious\n"
    (short_dir / "adir").mkdir()
    code, err = serve(capsys, tmp_path / "data", "--socket", str(short_dir / "adir"))
    assert code == 2
    assert_one_line(err, "exists and is not a socket")
    assert (short_dir / "adir").is_dir()
    os.symlink(victim, short_dir / "link")
    with pytest.raises(ConfigError, match="exists and is not a socket"):
        _remove_stale_socket(short_dir / "link")
    assert (short_dir / "link").is_symlink()


def test_a_dead_daemons_socket_is_removed(short_dir: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(short_dir / "s"))
    stale.close()  # the file stays; nobody listens
    assert stat.S_ISSOCK(os.lstat(short_dir / "s").st_mode)
    _remove_stale_socket(short_dir / "s")
    assert not (short_dir / "s").exists()
    _remove_stale_socket(short_dir / "s")  # nothing there: nothing to do


def test_startup_errors_are_one_line_exit_2_and_leave_no_socket(tmp_path: Path, short_dir: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    sock = short_dir / "s"
    try:
        code, err = serve(capsys, tmp_path / "a", "--socket", str(sock), "--listen", f"127.0.0.1:{port}")
    finally:
        taken.close()
    assert code == 2
    assert_one_line(err, f"cannot listen on 127.0.0.1:{port}: Address already in use")
    assert not sock.exists()  # bound before the TCP port failed: removed again
    code, err = serve(capsys, tmp_path / "b", "--socket", str(sock), "--token", "t",
                      "--listen", "nosuchhost.invalid:17973")
    assert code == 2
    assert_one_line(err, "cannot listen on nosuchhost.invalid:17973: ")
    assert not sock.exists()
    long_path = f"{short_dir}/{'x' * 120}"
    code, err = serve(capsys, tmp_path / "c", "--socket", long_path)
    assert code == 2
    assert_one_line(err, f"is {len(long_path)} bytes long; a Unix socket path has at most 107")
    afile = tmp_path / "afile"
    afile.write_text("precious\n")
    code, err = serve(capsys, afile, "--socket", str(sock))
    assert code == 2
    assert_one_line(err, f"--data-dir {afile} exists and is not a directory")
    assert afile.read_text() == "precious\n" and not sock.exists()


def test_serving_nothing_and_an_empty_tokens_file_off_loopback_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = serve(capsys, tmp_path / "data", "--socket", "none", "--listen", "none", "--http", "none")
    assert code == 2
    assert_one_line(err, "--socket, --listen and --http are all off")
    for text in ("", "tenant = []\n", '[[tenants]]\nname = "a"\ntokens = ["t"]\n'):
        tokens = tmp_path / "tokens.toml"
        tokens.write_text(text)
        code, err = serve(capsys, tmp_path / "data", "--socket", "none", "--listen", "0.0.0.0:0",
                          "--tokens", str(tokens))
        assert code == 2
        assert_one_line(err, f"tokens file {tokens}")


def test_a_second_daemon_on_a_held_data_dir_or_socket_is_refused(holder: DaemonProc, short_dir: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    own = short_dir / "s"
    code, err = serve(capsys, holder.data_dir, "--socket", str(own), "--disk-size", "2MiB")
    assert code == 2
    assert_one_line(err, f"cannot reopen --data-dir {holder.data_dir}: ",
                    f"is already open (lock held by pid {holder.proc.pid})")
    assert not own.exists()
    live = Path(holder.unix.removeprefix("unix://"))
    code, err = serve(capsys, short_dir / "data", "--socket", str(live))
    assert code == 2
    assert_one_line(err, f"another daemon is listening on {live}")
    assert stat.S_ISSOCK(os.lstat(live).st_mode)
    with holder.connect() as client:  # its socket was left alone
        assert client.lookup(client.block_keys(prompt(1, 2))).num_blocks == 2


def test_a_failed_start_exits_2_without_a_traceback(holder: DaemonProc, short_dir: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvstore.services.daemon", "serve", "--data-dir", str(holder.data_dir),
                           "--listen", "", "--http", "", "--socket", str(short_dir / "s"), "--host-mem", "1MiB",
                           "--disk-size", "2MiB"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert_one_line(proc.stderr, "is already open (lock held by pid")
    assert not (short_dir / "s").exists()


# --------------------------------------------------------------------------- the socket file


def watch(directory: Path) -> Callable[[], list[tuple[str, int]]]:
    """inotify on ``directory``: a function returning the (name, mask) events since the last call."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0 or libc.inotify_add_watch(fd, bytes(directory), IN_CREATE | IN_ATTRIB) < 0:
        pytest.skip("inotify is not available")

    def events() -> list[tuple[str, int]]:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return []
        out, at = [], 0
        while at < len(data):
            _wd, mask, _cookie, size = struct.unpack_from("iIII", data, at)
            out.append((data[at + 16:at + 16 + size].rstrip(b"\0").decode(), mask))
            at += 16 + size
        return out

    return events


def run_daemon(config: DaemonConfig, while_up: Callable[[Daemon], None]) -> None:
    async def go() -> None:
        daemon = Daemon(config)
        await daemon.start()
        try:
            while_up(daemon)
        finally:
            await daemon.shutdown(time.monotonic() + 1.0)

    asyncio.run(go())


def test_the_socket_is_0600_from_its_creation_and_the_umask_is_restored(tmp_path: Path, short_dir: Path) -> None:
    sock = short_dir / "s"
    config = DaemonConfig(data_dir=tmp_path / "data", store_settings=HOST_ONLY, socket_path=str(sock),
                          listen="", http="")
    events = watch(short_dir)
    umask = os.umask(0)  # the loosest: a socket bound under it is 0777 until changed
    try:
        seen: list[tuple[str, int]] = []

        def check(daemon: Daemon) -> None:
            assert os.umask(0) == 0  # restored after the bind
            assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o600
            seen.extend(events())

        run_daemon(config, check)
    finally:
        os.umask(umask)
    assert ("s", IN_CREATE) in seen, seen
    assert not [mask for name, mask in seen if name == "s" and mask & IN_ATTRIB], seen  # never chmodded
    assert not sock.exists()  # shutdown removed its own socket


def test_shutdown_leaves_a_socket_that_replaced_its_own(tmp_path: Path, short_dir: Path) -> None:
    sock = short_dir / "s"
    config = DaemonConfig(data_dir=tmp_path / "data", store_settings=HOST_ONLY, socket_path=str(sock),
                          listen="", http="")
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def replace(daemon: Daemon) -> None:
        sock.unlink()
        other.bind(str(sock))  # another daemon took the path over
        other.listen()

    try:
        run_daemon(config, replace)
        assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    finally:
        other.close()
