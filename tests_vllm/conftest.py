"""The vLLM suite (``make test-vllm``): a real vLLM CPU build, real daemons, a tiny random Llama.

It runs in its own venv (.venv-vllm, pinned vLLM). Without vLLM the suite skips, except under
CI=true, where a missing vLLM fails it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).resolve().parent / "vllm_run.py"

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError("vLLM is not installed in this Python; CI runs these tests with `make test-vllm`")
    pytest.skip("vLLM is not installed (make test-vllm installs it)", allow_module_level=True)


def run_plan(plan: list[dict[str, Any]], timeout: float = 300, log: list[str] | None = None) -> list[Any]:
    """Run ``plan`` (see vllm_run.py) in a fresh Python process; its results (``log``: gets the
    process's stderr, vLLM's log at WARNING and above, appended)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, str(RUNNER), json.dumps(plan)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM process failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    if log is not None:
        log.append(proc.stderr)
    return json.loads(lines[-1][len("RESULT "):])  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvstore.tools.bench.tiny_llama import save_tiny_llama

    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_gemma3 import save_tiny_gemma3

    return str(save_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3")))
