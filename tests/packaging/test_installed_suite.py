"""A part of this suite run against the installed wheel, as tox runs a suite: the test files
copied to a directory outside the checkout, the venv's pytest, nothing of the checkout on
``sys.path``. The parts picked need none of the checkout's paths: the store API, the engine's
parity with transformers, a real daemon process."""

from __future__ import annotations

import re
import shutil

import pytest

from wheel_venv import ROOT, InstalledWheel, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first test pays for the install

COPIED = [  # relative to the checkout, with the conftest files and helpers they import
    "pyproject.toml",  # pytest's settings: markers, the timeout
    "tests/conftest.py",
    "tests/factories.py",
    "tests/store/test_store.py",
    "tests/store/test_store_listeners.py",
    "tests/engine/conftest.py",
    "tests/engine/test_model_parity.py",
    "tests/daemon/daemon_helpers.py",
    "tests/daemon/test_daemon_basic.py",
]
# Run with them: the kvstore those tests imported is the installed one.
INSTALLED_CHECK = '''"""Written by tests/packaging/test_installed_suite.py."""

import sysconfig
from pathlib import Path

import kvstore


def test_kvstore_is_the_installed_wheel() -> None:
    assert Path(kvstore.__file__).is_relative_to(sysconfig.get_paths()["purelib"]), kvstore.__file__
'''


def test_part_of_the_suite_passes_against_the_installed_wheel(installed: InstalledWheel) -> None:
    copy = installed.outside / "suite"
    for name in COPIED:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, copy / name)
    (copy / "tests" / "test_installed_kvstore.py").write_text(INSTALLED_CHECK)
    assert not (copy / "kvstore").exists()
    proc = run([installed.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=copy,
               timeout=900)
    summary = proc.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 20, proc.stdout[-4000:]
    assert "failed" not in summary and "error" not in summary, proc.stdout[-4000:]
