"""Real daemon processes for the daemon tests: start on temp dirs and free ports, stop, kill."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

import kvstore
from kvstore import KVLayout
from kvstore.client.client import StoreClient

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)  # 512 B blocks


class DaemonProc:
    """``python -m kvstore.services.daemon serve`` in a subprocess; the addresses it printed."""

    def __init__(self, data_dir: Path, *args: str, host_mem: str = "1MiB", disk: str = "2MiB",
                 env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.sock_dir = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")  # short: sun_path is 108 bytes
        self.args = ["--data-dir", str(data_dir), "--host-mem", host_mem, "--disk-size", disk,
                     "--socket", f"{self.sock_dir}/s", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", *args]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.services.daemon", "serve", *self.args], cwd=ROOT,
                                     env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        deadline = time.monotonic() + 60
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"daemon exited ({self.proc.wait()}): {''.join(self.lines)}")
            self.lines.append(line)
            if "ready" in line:
                break
        else:
            raise RuntimeError(f"daemon not ready in time: {''.join(self.lines)}")
        self.unix = re.search(r"(unix://\S+?),", line).group(1)  # type: ignore[union-attr]
        self.tcp = re.search(r"(tcp://\S+?),", line).group(1)  # type: ignore[union-attr]
        self.http = re.search(r"(http://[^\s,]+)", line).group(1)  # type: ignore[union-attr]
        threading.Thread(target=self._drain_output, daemon=True).start()

    def _drain_output(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def connect(self, token: str | None = None, url: str | None = None, **kw: object) -> StoreClient:
        kw.setdefault("model_id", "test-model")
        kw.setdefault("layout", LAYOUT)
        return kvstore.connect(url or self.unix, token=token, **kw)  # type: ignore[arg-type]

    def stop(self, timeout: float = 8.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    @property
    def output(self) -> str:
        return "".join(self.lines)


@pytest.fixture(name="daemon")
def daemon_fixture(tmp_path: Path):  # type: ignore[no-untyped-def]
    proc = DaemonProc(tmp_path / "data")
    yield proc
    if proc.proc.poll() is None:
        proc.kill9()


@pytest.fixture(scope="module", name="shared_daemon")
def shared_daemon_fixture(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One daemon for a whole module (a start costs seconds on a loaded 2-core machine)."""
    proc = DaemonProc(tmp_path_factory.mktemp("shared") / "data")
    yield proc
    if proc.proc.poll() is None:
        proc.kill9()


def blocks(keys: list[bytes], layout: KVLayout = LAYOUT) -> torch.Tensor:
    """Deterministic contents derived from each key (any process can check them)."""
    import hashlib

    rows = []
    for key in keys:
        seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)
        rows.append(torch.randn(layout.block_shape, generator=torch.Generator().manual_seed(seed)).to(layout.dtype))
    return torch.stack(rows) if rows else torch.empty((0, *layout.block_shape), dtype=layout.dtype)


def prompt(salt: int, num_blocks: int, block_size: int = LAYOUT.block_size) -> list[int]:
    return [salt * 1_000_003 % (1 << 31) + i for i in range(num_blocks * block_size)]


def call(url: str, method: str = "GET", body: Any = None, token: str | None = None,
         timeout: float = 20.0) -> tuple[int, Any]:
    """A REST call: its status and its JSON body (the text where the body is not JSON), errors included."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    if token:
        req.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as err:
        raw, status = err.read(), err.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()
