"""One installed wheel for the whole session (a build and an install take a minute or two)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from factories import require
from wheel_venv import InstalledWheel, install


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory,
              request: pytest.FixtureRequest) -> Iterator[InstalledWheel]:
    require(_has_ensurepip(), "no ensurepip: python -m venv makes no venv with pip (Debian: python3-venv)")
    wheel = install(tmp_path_factory.mktemp("installed"))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        steps = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in wheel.install_seconds.items())
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"tests/packaging: {steps}")
    yield wheel
    shutil.rmtree(wheel.venv, ignore_errors=True)  # torch, triton, transformers: 2.5 GB


def _has_ensurepip() -> bool:
    try:
        import ensurepip  # noqa: F401
    except ImportError:
        return False
    return True
