"""The daemon end to end: a real process, real sockets, the client's TieredStore semantics."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvstore import CapacityError, KVLayout, LayoutMismatchError
from kvstore.errors import ConfigError
from kvstore.layout import KVGroup
from kvstore.protocol import Code, RemoteError
from kvstore.services.daemon.config import default_host_bytes, load_config

from daemon_helpers import LAYOUT, ROOT, DaemonProc, blocks, daemon_fixture, prompt, shared_daemon_fixture  # noqa: F401


@pytest.mark.parametrize("transport", ["unix-shm", "unix", "tcp"])
def test_put_lookup_get_fetch_roundtrip(shared_daemon: DaemonProc, transport: str) -> None:
    daemon = shared_daemon
    url = daemon.tcp if transport == "tcp" else daemon.unix
    with daemon.connect(url=url, shm=transport == "unix-shm") as s:
        assert s.uses_shm == (transport == "unix-shm")
        keys = s.block_keys(prompt(len(transport), 12))
        held_before = s.stats()["host"]["num_blocks"]  # the daemon is shared by the module
        assert s.lookup(keys).num_blocks == 0
        s.put(keys, blocks(keys))
        m = s.lookup(keys)
        assert m.num_blocks == 12 and set(m.tiers) == {"host"}
        assert torch.equal(s.get(keys), blocks(keys))
        into = torch.full((12, *LAYOUT.block_shape), float("nan"))
        result = s.fetch(keys, into=into).result(timeout=10)
        assert result.num_blocks == 12 and torch.equal(into, blocks(keys))
        assert s.contains(keys[:2] + s.block_keys(prompt(99, 1))) == [True, True, False]
        s.pin(keys[:3])
        with pytest.raises(CapacityError):
            s.delete(keys[:3])
        s.unpin(keys[:3])
        with pytest.raises(ValueError):
            s.unpin(keys[:1])  # not pinned
        assert s.delete(keys[6:]) == 6
        with pytest.raises(KeyError):
            s.get(keys)
        assert s.fetch(keys, into=into).result(timeout=10).num_blocks == 6
        stats = s.stats()
        assert stats["host"]["num_blocks"] == held_before + 6
        standing = 24 if transport == "unix-shm" else 0  # the slots reserved for the next two puts
        assert stats["host"]["used_bytes"] == (held_before + 6 + standing) * 4096
        with pytest.raises(LayoutMismatchError):
            s.put(keys[:1], torch.zeros((2, *LAYOUT.block_shape)))


def test_blocks_demote_to_disk_and_survive_restart(tmp_path: Path) -> None:
    # 1 MiB host over 4 namespace slots = 64 host slots of 4 KiB; disk 2 MiB = 128 slots.
    d = DaemonProc(tmp_path / "data")
    with d.connect() as s:
        chains = [s.block_keys(prompt(i, 16)) for i in range(6)]  # 96 blocks > 64 host slots
        for keys in chains:
            s.put(keys, blocks(keys))
        tiers = [t for keys in chains for t in s.lookup(keys).tiers]
        assert len(tiers) == 96 and "disk" in tiers
        for keys in chains:
            assert torch.equal(s.get(keys), blocks(keys))
    t0 = time.monotonic()
    assert d.stop() == 0
    assert time.monotonic() - t0 < 5.0
    d.start()
    with d.connect() as s:
        for keys in chains:
            assert s.lookup(keys).num_blocks == 16
            assert torch.equal(s.get(keys), blocks(keys))
    assert d.stop() == 0


def test_tenants_never_meet(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[[tenant]]\nname = "acme"\ntokens = ["tok-acme"]\n\n'
                      '[[tenant]]\nname = "globex"\ntokens = ["tok-globex"]\n')
    d = DaemonProc(tmp_path / "data", "--tokens", str(tokens), "--token", "tok-admin")
    try:
        a, b = d.connect("tok-acme"), d.connect("tok-globex", url=d.tcp)
        assert (a.tenant, b.tenant) == ("acme", "globex")
        ka = a.block_keys(prompt(5, 70))  # more than the host share: reaches disk too
        a.put(ka, blocks(ka))
        # globex sends the very keys acme used (as if it knew acme's salt and prompt)
        assert b.lookup(ka).num_blocks == 0 and b.contains(ka) == [False] * 70
        with pytest.raises(KeyError):
            b.get(ka[:1])
        assert b.delete(ka) == 0
        kb = b.block_keys(prompt(5, 70))  # same prompt, globex's own salt
        assert kb != ka and b.lookup(kb).num_blocks == 0
        a.close()
        b.close()
        assert d.stop() == 0
        d.start()
        a, b = d.connect("tok-acme"), d.connect("tok-globex")
        assert a.lookup(ka).num_blocks == 70 and torch.equal(a.get(ka), blocks(ka))
        assert b.lookup(ka).num_blocks == 0 and b.lookup(kb).num_blocks == 0
        with pytest.raises(RemoteError) as err:
            d.connect("wrong-token")
        assert err.value.code == Code.AUTH
        with pytest.raises(RemoteError):
            d.connect(None)
        a.close()
        b.close()
    finally:
        d.stop()


def test_namespaces_share_the_daemon_within_the_total(daemon: DaemonProc) -> None:
    other = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)
    with daemon.connect() as s1, daemon.connect(layout=other, model_id="m2") as s2:
        assert s1.namespace_id != s2.namespace_id
        k1, k2 = s1.block_keys(prompt(1, 2)), s2.block_keys(prompt(1, 2))
        s1.put(k1, blocks(k1))
        s2.put(k2, blocks(k2, other))
        assert s2.lookup(k1).num_blocks == 0 and torch.equal(s2.get(k2), blocks(k2, other))
        host = s1.stats()["host"]["capacity_bytes"] + s2.stats()["host"]["capacity_bytes"]
        assert host <= (1 << 20) // 2
    extra = [daemon.connect(model_id=f"x{i}") for i in range(2)]  # fills slots 3 and 4
    with pytest.raises(LayoutMismatchError, match="namespace slots"):
        daemon.connect(model_id="one-too-many")
    for c in extra:
        c.close()
    # SIGTERM with a client still connected: drains and exits 0 within 5 s
    s = daemon.connect()
    keys = s.block_keys(prompt(3, 8))
    s.put(keys, blocks(keys))
    t0 = time.monotonic()
    assert daemon.stop() == 0  # a client still connected does not hold it up
    assert time.monotonic() - t0 < 5.0
    assert "stopped" in daemon.output


def test_off_loopback_needs_a_token(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvstore.services.daemon", "serve", "--data-dir", str(tmp_path),
                           "--listen", "0.0.0.0:0", "--http", "", "--socket", "", "--host-mem", "1MiB"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "token is required" in proc.stderr


def test_a_taken_rest_port_is_a_clear_error(tmp_path: Path) -> None:
    daemon = DaemonProc(tmp_path / "a")
    try:
        taken = daemon.http.removeprefix("http://")
        proc = subprocess.run([sys.executable, "-m", "kvstore.services.daemon", "serve", "--data-dir", str(tmp_path / "b"),
                               "--listen", "", "--http", taken, "--socket", "", "--host-mem", "1MiB", "--disk-size", "0"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert f"cannot listen on {taken}" in proc.stderr and "Traceback" not in proc.stderr
    finally:
        daemon.stop()


def test_host_ram_defaults_when_left_out_and_zero_is_refused(tmp_path: Path) -> None:
    assert load_config(None, {"data_dir": tmp_path}).store_settings.host_bytes == default_host_bytes()
    assert load_config(None, {"data_dir": tmp_path, "host_bytes": "64MiB"}).store_settings.host_bytes == 64 << 20
    with pytest.raises(ConfigError, match="host_bytes=0 leaves no slot for 4 namespaces"):
        load_config(None, {"data_dir": tmp_path, "host_bytes": "0"})
    proc = subprocess.run([sys.executable, "-m", "kvstore.services.daemon", "serve", "--data-dir", str(tmp_path),
                           "--listen", "", "--http", "", "--host-mem", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "every put lands in host RAM" in proc.stderr, proc.stderr


def test_a_put_the_full_disk_cannot_take_is_refused_not_acknowledged(tmp_path: Path) -> None:
    """The daemon writes through to disk: a put whose blocks the full filesystem refuses comes
    back as an error the client raises (CapacityError: a full disk is no room), not as an
    acknowledgement, and the daemon logs no traceback; once there is room again puts work."""
    fs = tmp_path / "fs"
    fs.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(fs)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        d = DaemonProc(fs / "data", "--no-shm")
        try:
            with d.connect() as s:
                first = s.block_keys(prompt(1, 2))
                s.put(first, blocks(first))  # the namespace's files exist now
                filler = fs / "filler"
                with open(filler, "wb", buffering=0) as f, pytest.raises(OSError):  # ENOSPC
                    while True:
                        f.write(b"\0" * (64 << 10))
                keys = s.block_keys(prompt(2, 8))
                with pytest.raises(CapacityError, match="not acknowledged under write-through"):
                    s.put(keys, blocks(keys))
                assert s.lookup(keys).num_blocks == 0
                filler.unlink()
                s.put(keys, blocks(keys))
                assert s.lookup(keys).num_blocks == 8 and torch.equal(s.get(keys), blocks(keys))
        finally:
            assert d.stop() == 0
        assert d.proc.stdout is not None
        log = "".join(d.lines) + d.proc.stdout.read()  # all it printed, to its exit
        assert "Traceback" not in log, log  # an error reply, not a bug report
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)


def test_once_close_returns_the_daemon_has_ended_the_connection(tmp_path: Path) -> None:
    """close() waits for the daemon to end the connection: its pins are gone (another client
    deletes the blocks at once), the slots its write leases held are free, and it no longer
    counts against max_connections (a new connection right after is served, every time).
    Before, the daemon ended it a moment later, so each of these could fail."""
    config = tmp_path / "kvstore.toml"
    config.write_text("max_connections = 2\n")
    d = DaemonProc(tmp_path / "data", "--config", str(config), "--max-namespaces", "1", host_mem="1MiB", disk="0")
    try:
        with d.connect(shm=False) as other:
            for i in range(25):
                c = d.connect(shm=True)
                keys = c.block_keys(prompt(100 + i, 4))
                c.put(keys, blocks(keys))
                c.pin(keys)
                c.close()
                assert other.delete(keys) == 4  # a pinned block would be refused
                assert other.stats()["host"]["used_bytes"] == 0  # no slot still reserved ahead
    finally:
        assert d.stop() == 0


def test_a_client_whose_kv_groups_disagree_with_the_daemons_is_refused_at_hello(tmp_path: Path) -> None:
    """Two engines of one model that disagree on which layers slide would hash and store blocks
    the other cannot use: the second is refused at hello, both layouts named."""
    sliding = KVLayout(2, 1, 8, 4, torch.float16, groups=(KVGroup("sliding", (0, 2), 8), KVGroup("full", (1, 3))))
    other = KVLayout(2, 1, 8, 4, torch.float16, groups=(KVGroup("sliding", (0, 1), 8), KVGroup("full", (2, 3))))
    d = DaemonProc(tmp_path / "data")
    try:
        with d.connect(layout=sliding, model_id="gemma-like") as s:
            assert s.layout == sliding and s.namespace.layout.num_groups == 2
            keys = s.group_keys(s.block_keys(prompt(7, 2)), 1)
            s.put(keys, blocks(keys, sliding), group=1)  # a group's blocks, named as such (shared memory)
            assert s.lookup(keys).num_blocks == 2
        with d.connect(url=d.tcp, layout=sliding, model_id="gemma-like") as s:  # over the socket
            keys = s.group_keys(s.block_keys(prompt(8, 2)), 0)
            s.put(keys, blocks(keys, sliding), group=0)
            with pytest.raises(ValueError, match="group 2 is not one of the namespace's 2 KV groups"):
                s.put(keys, blocks(keys, sliding), group=2)
        with d.connect(layout=sliding, model_id="gemma-like") as s:
            with pytest.raises(LayoutMismatchError) as refused:
                d.connect(layout=other, model_id="gemma-like")
            assert sliding.fingerprint() in str(refused.value) and other.fingerprint() in str(refused.value)
            with d.connect(layout=other, model_id="another-model"):  # another model: its own namespace
                pass
    finally:
        d.stop()
