"""One wheel for the whole session, installed once with its test extra and once bare (a build
and an install take a minute or two)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from factories import require
from wheel_venv import InstalledWheel, build_wheel, install, install_bare


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """The wheel built from a clean copy of the checkout."""
    t = time.monotonic()
    built = build_wheel(tmp_path_factory.mktemp("wheel"))
    _report(request, f"tests/packaging: build wheel {time.monotonic() - t:.1f} s")
    return built


@pytest.fixture(scope="session")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory,
              request: pytest.FixtureRequest) -> Iterator[InstalledWheel]:
    """A fresh venv with ``wheel[test]`` and the default model."""
    require(_has_ensurepip(), "no ensurepip: python -m venv makes no venv with pip (Debian: python3-venv)")
    venv = install(tmp_path_factory.mktemp("installed"), wheel)
    _report(request, "tests/packaging: " + ", ".join(f"{step} {s:.1f} s" for step, s in venv.install_seconds.items()))
    yield venv
    shutil.rmtree(venv.venv, ignore_errors=True)  # torch, triton, transformers: 2.5 GB


@pytest.fixture(scope="session")
def bare(wheel: Path, tmp_path_factory: pytest.TempPathFactory,
         request: pytest.FixtureRequest) -> Iterator[InstalledWheel]:
    """A fresh venv with torch and ``pip install <wheel>``: no extra."""
    require(_has_ensurepip(), "no ensurepip: python -m venv makes no venv with pip (Debian: python3-venv)")
    venv = install_bare(wheel, tmp_path_factory.mktemp("bare"))
    _report(request, "tests/packaging, bare: " + ", ".join(f"{step} {s:.1f} s"
                                                           for step, s in venv.install_seconds.items()))
    yield venv
    shutil.rmtree(venv.venv, ignore_errors=True)


def _report(request: pytest.FixtureRequest, line: str) -> None:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)


def _has_ensurepip() -> bool:
    try:
        import ensurepip  # noqa: F401
    except ImportError:
        return False
    return True
