"""Every code block of README.md works as written.

Each ```` ```python ```` block runs as it is, in a fresh interpreter whose working directory
is an empty temporary directory (so ``./.kvstore`` and other relative paths start empty).
Words after ``python`` in the fence's info string name what the block needs first; GitHub
ignores them when it renders the page:

    daemon                 a real ``kvstore serve`` with its defaults in that directory (data
                           in ./.kvstore, socket ./.kvstore/kvstore.sock), small sizes, no TCP
    hf-checkpoint=PATH     a small random Llama checkpoint (Hugging Face layout) at PATH
    redis-cluster=PORT     a real local Redis Cluster (kvstore.tools.bench.redis_local: 3 primaries and 3
                           replicas) on PORT .. PORT+5
    engine                 a real ``kvstore engine --random-model --port 8000`` (small sizes)
    smollm2-engine         a real ``kvstore engine --port 8000``: the default model, SmolLM2

A block that needs something else gets a new word and a fixture below, never a skip.
Each ```` ```sh ```` line that runs ``kvstore ...`` must parse with the real command line
(nothing is run: they start servers and benchmarks); ``make X`` must name a Makefile target.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from kvstore.cli import build_parser
from kvstore.engine.checkpoint import SMOLLM2_FILE, SMOLLM2_INSTALL, smollm2_gguf

from factories import require

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
TINY_LLAMA = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                  head_dim=16, vocab_size=256, max_position_embeddings=512)


def blocks(language: str) -> list[tuple[int, list[str], str]]:
    """``(line, info words after the language, code)`` of each README block in ``language``."""
    text = README.read_text()
    out = []
    for m in FENCE.finditer(text):
        words = m.group(1).split()
        if words and words[0] == language:
            out.append((text.count("\n", 0, m.start()) + 1, words[1:], m.group(2)))
    return out


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT), "PYTHONUNBUFFERED": "1"}


@contextmanager
def _running(cwd: Path, command: str, args: list[str]) -> Iterator[None]:
    """``kvstore COMMAND ARGS`` in the background until the block ends; it must print "ready"
    first, and drain and exit 0 on SIGTERM after."""
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", command, *args], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "ready" in line:
            break
    else:
        raise RuntimeError(f"kvstore {command} did not start (exit {proc.wait()}): {''.join(lines)}")
    try:
        yield
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, f"kvstore {command} did not drain and exit 0 on SIGTERM"


def running_daemon(cwd: Path, _arg: str) -> AbstractContextManager[None]:
    return _running(cwd, "serve", ["--host-mem", "64MiB", "--disk-size", "128MiB", "--listen", "", "--http", ""])


def running_engine(cwd: Path, _arg: str) -> AbstractContextManager[None]:
    return _running(cwd, "engine", ["--random-model", "--port", "8000", "--host-mem", "16MiB", "--kv-cache", "16MiB"])


def running_smollm2_engine(cwd: Path, _arg: str) -> AbstractContextManager[None]:
    require(smollm2_gguf(), f"{SMOLLM2_FILE} is not installed ({SMOLLM2_INSTALL})")
    return _running(cwd, "engine", ["--port", "8000", "--host-mem", "64MiB", "--kv-cache", "64MiB"])


@contextmanager
def hf_checkpoint(cwd: Path, path: str) -> Iterator[None]:
    from kvstore.engine.checkpoint import random_checkpoint, save_random_checkpoint

    save_random_checkpoint(cwd / path, random_checkpoint(TINY_LLAMA, 0))
    yield


@contextmanager
def redis_cluster(cwd: Path, port: str) -> Iterator[None]:
    from kvstore.tools.bench.redis_local import RedisCluster

    cluster = RedisCluster.start(cwd / "redis-cluster", base_port=int(port))
    try:
        yield
    finally:
        cluster.close()


FIXTURES: dict[str, Callable[[Path, str], AbstractContextManager[None]]] = {
    "daemon": running_daemon,
    "hf-checkpoint": hf_checkpoint,
    "engine": running_engine,
    "smollm2-engine": running_smollm2_engine,
    "redis-cluster": redis_cluster,
}


@pytest.mark.parametrize(("line", "needs", "code"),
                         [pytest.param(*b, id=f"line{b[0]}") for b in blocks("python")])
def test_python_block_runs(line: int, needs: list[str], code: str, tmp_path: Path) -> None:
    with _fixtures(needs, tmp_path):
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True,
                              text=True, timeout=240)
    assert proc.returncode == 0, f"README.md line {line}:\n{code}\n--- stderr ---\n{proc.stderr[-4000:]}"


@contextmanager
def _fixtures(needs: list[str], cwd: Path) -> Iterator[None]:
    if not needs:
        yield
        return
    name, _, arg = needs[0].partition("=")
    if name not in FIXTURES:
        raise AssertionError(f"README fence word {name!r} names no fixture (known: {sorted(FIXTURES)})")
    with FIXTURES[name](cwd, arg), _fixtures(needs[1:], cwd):
        yield


def test_readme_has_python_blocks() -> None:
    assert len(blocks("python")) >= 3  # the parser still finds them


def test_sh_lines_are_real_commands() -> None:
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    parser = build_parser()
    checked = 0
    for line, _needs, code in blocks("sh"):
        for row in code.splitlines():
            command = row.split("#", 1)[0].strip()
            if command.startswith("make "):
                assert command.split()[1] in targets, f"README.md line {line}: no Makefile target in {row!r}"
            elif command.startswith("kvstore "):
                argv = shlex.split(command)[1:]
                try:
                    parser.parse_args(argv)
                except SystemExit as exc:  # --help exits 0; a bad command line exits 2
                    assert exc.code == 0, f"README.md line {line}: {row!r} does not parse"
            else:
                continue
            checked += 1
    assert checked >= 5
