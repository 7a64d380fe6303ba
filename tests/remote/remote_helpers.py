"""Shared helpers of the remote tests: keys, deterministic payloads, a tier factory."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import redis
from redis.crc import key_slot

from kvstore.tiers.remote import RemoteTier
from kvstore.tools.bench.redis_local import RedisCluster

PAYLOAD = 64 * 1024
LAYOUT_ID = "L2-H2-D64-B16-float16-tp0of1"


def keys(tag: str, n: int) -> list[bytes]:
    """``n`` distinct 32-byte keys, different for every ``tag``."""
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def payloads(ks: list[bytes], size: int = PAYLOAD) -> np.ndarray:
    """Contents derived from each key, so any reader can tell right bytes from wrong."""
    rows = [np.random.default_rng(int.from_bytes(k[:8], "little")).integers(0, 256, size, dtype=np.uint8)
            for k in ks]
    return np.stack(rows)


def tier(url: str, **kwargs: object) -> RemoteTier:
    kwargs.setdefault("timeout_s", 2.0)  # generous: a loaded 2-core CI machine; fault tests set their own
    return RemoteTier(url, PAYLOAD, LAYOUT_ID, **kwargs)  # type: ignore[arg-type]


def owner_port(cluster: RedisCluster, name: bytes) -> int:
    """The port of the live primary that holds ``name`` (asked of the cluster itself)."""
    slot = key_slot(name)
    seed = next(n for n in cluster.nodes if n.alive)
    for entry in redis.Redis(port=seed.port).execute_command("CLUSTER", "SLOTS"):
        if entry[0] <= slot <= entry[1]:
            return int(entry[2][1])
    raise AssertionError(f"no owner of slot {slot}")


class Daemon:
    """``kvstore serve`` in a subprocess (real sockets, real REST), its addresses and output."""

    def __init__(self, data_dir: Path, *args: str) -> None:
        self.sock_dir = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")  # sun_path is 108 bytes
        cmd = [sys.executable, "-m", "kvstore.services.daemon", "serve", "--data-dir", str(data_dir), "--host-mem", "2MiB",
               "--disk-size", "0", "--socket", f"{self.sock_dir}/s", "--listen", "", "--http", "127.0.0.1:0", *args]
        self.proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        self.lines: list[str] = []
        for line in self.proc.stdout:
            self.lines.append(line)
            if "ready" in line:
                break
        else:
            raise RuntimeError(f"kvstore serve exited ({self.proc.wait()}): {''.join(self.lines)}")
        self.unix = f"unix://{self.sock_dir}/s"
        self.http = re.search(r"(http://[^\s,]+)", line).group(1)  # type: ignore[union-attr]
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.http + path, timeout=20) as r:
            return r.read().decode()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class TrickleNode:
    """A small real RESP3 server on a loopback socket: a node that stalls yet keeps sending.

    Connection setup (HELLO, CLIENT, PING, SELECT) and ``CLUSTER SLOTS`` (from ``slots``:
    ``(first, last, port)`` ranges) are answered at once; every other reply is written one byte
    per ``byte_delay`` seconds, so no single socket read ever waits long enough to time out.
    ``asked`` lists the name of every command it got. A long ``byte_delay`` is a node that
    accepts and then never answers.
    """

    def __init__(self, byte_delay: float = 0.3) -> None:
        self.byte_delay = byte_delay
        self.slots: list[tuple[int, int, int]] = []
        self.asked: list[bytes] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while not self._closed:
                line = reader.readline()
                if not line:
                    return
                args = []
                for _ in range(int(line[1:])):
                    size = int(reader.readline()[1:])
                    args.append(reader.read(size + 2)[:-2])
                name = args[0].upper()
                self.asked.append(name)
                if name == b"HELLO":
                    conn.sendall(b"%1\r\n+proto\r\n:3\r\n")
                elif name in (b"CLIENT", b"SELECT", b"ASKING"):
                    conn.sendall(b"+OK\r\n")
                elif name == b"PING":
                    conn.sendall(b"+PONG\r\n")
                elif name == b"CLUSTER":
                    conn.sendall(self._slots_reply())
                else:
                    for byte in b":0\r\n" if name in (b"EXISTS", b"DEL") else b"_\r\n":
                        time.sleep(self.byte_delay)  # a byte at a time, late: the slow node under test
                        conn.sendall(bytes([byte]))
        except OSError:
            return  # the client gave up on us: what this node is for
        finally:
            conn.close()

    def _slots_reply(self) -> bytes:
        out = [f"*{len(self.slots)}\r\n".encode()]
        for first, last, port in self.slots:
            out.append(f"*3\r\n:{first}\r\n:{last}\r\n*2\r\n$9\r\n127.0.0.1\r\n:{port}\r\n".encode())
        return b"".join(out)

    def close(self) -> None:
        self._closed = True
        self._server.close()

    def __enter__(self) -> TrickleNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
