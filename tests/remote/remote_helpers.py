"""Shared helpers of the remote tests: keys, deterministic payloads, a tier factory."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

import numpy as np
import redis
from redis.crc import key_slot

from kvstore.redis_local import RedisCluster
from tiers.remote import RemoteTier

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
        cmd = [sys.executable, "-m", "kvstore.daemon", "serve", "--data-dir", str(data_dir), "--host-mem", "2MiB",
               "--disk", "0", "--socket", f"{self.sock_dir}/s", "--listen", "", "--http", "127.0.0.1:0", *args]
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
