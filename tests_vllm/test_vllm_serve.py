"""docs/vllm.md's server line, as written: a real OpenAI-compatible server, the official
``openai`` client, a real daemon. The server saves a prompt, forgets its own prefix cache, and
serves the prompt again from kvstore with the same completion."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
from conftest import ROOT

from tests.daemon.daemon_helpers import DaemonProc
from tests.waiting import wait_until

P = [(i * 7919) % 997 + 2 for i in range(600)]  # 4 loadable 128-token blocks


def docs_serve_command(model_dir: str, socket_url: str) -> list[str]:
    """docs/vllm.md's CPU server line, as written; its arguments must be the `vllm serve` line's."""
    text = (ROOT / "docs" / "vllm.md").read_text()
    blocks = re.findall(r"^```sh\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    lines = [shlex.split(b.replace("\\\n", " "), comments=True) for b in blocks]
    (serve,) = [w for w in lines if w[:2] == ["vllm", "serve"]]
    (cpu,) = [w for w in lines if w[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]]
    assert serve[2] == "MODEL_DIR" and cpu[3:5] == ["--model", "MODEL_DIR"]
    assert serve[3:] == cpu[5:], "the CPU line must take the vllm serve line's arguments"
    args = [w.replace("unix:///run/kvstore/kvstore.sock", socket_url) for w in cpu[5:]]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_vllm_serve_loads_the_prefix_back_from_kvstore(model_dir: str, tmp_path: Path) -> None:
    daemon = DaemonProc(tmp_path / "data", host_mem="64MiB", disk="64MiB")
    port = free_port()
    # Test-only additions: where to listen, cached-token counts in `usage`, the dev endpoint
    # that empties vLLM's own prefix cache.
    cmd = [*docs_serve_command(model_dir, daemon.unix), "--host", "127.0.0.1", "--port", str(port),
           "--enable-prompt-tokens-details"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_SERVER_DEV_MODE": "1"}
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-6000:]
            return httpx.get(f"{base}/health", timeout=2).status_code == 200

        wait_until(healthy, 240, "vllm serve healthy", ignoring=(httpx.HTTPError,), poll_s=1)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")

        def complete() -> tuple[str, int]:
            r = client.completions.create(model=model_dir, prompt=P, max_tokens=8, temperature=0.0,
                                          extra_body={"ignore_eos": True})
            details = r.usage.prompt_tokens_details if r.usage else None
            return r.choices[0].text, (details.cached_tokens or 0) if details else 0

        first, cached_first = complete()  # computed, and saved to the daemon
        assert cached_first == 0 and len(first.split()) == 8
        assert httpx.post(f"{base}/reset_prefix_cache", timeout=30).json()["success"] is True
        again, cached_again = complete()
        assert cached_again == 4 * 128  # vLLM's cache is empty: the blocks came from kvstore
        assert again == first
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        log.close()
        daemon.kill9()
