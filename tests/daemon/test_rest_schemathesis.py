"""schemathesis against a real daemon's /openapi.json: no input yields a 5xx."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from daemon_helpers import DaemonProc, blocks, prompt
from factories import require

SCHEMATHESIS = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))


@pytest.mark.parametrize("token", ["tok-admin"])
def test_no_server_errors(tmp_path: Path, token: str) -> None:
    require(Path(SCHEMATHESIS).exists(), "schemathesis is not installed (pip extra 'test')")
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[[tenant]]\nname = "acme"\ntokens = ["tok-acme"]\n')
    d = DaemonProc(tmp_path / "data", "--tokens", str(tokens), "--token", "tok-admin")
    try:
        with d.connect("tok-acme") as c:
            keys = c.block_keys(prompt(1, 4))
            c.put(keys, blocks(keys))
        proc = subprocess.run(
            [SCHEMATHESIS, "run", f"{d.http}/openapi.json", "--checks", "not_a_server_error",
             "-H", f"Authorization: Bearer {token}", "--max-examples", "15", "--seed", "1",
             "--request-timeout", "20", "--workers", "1"],
            capture_output=True, text=True, timeout=150, cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        assert "Internal Server Error" not in d.output
    finally:
        d.stop()
