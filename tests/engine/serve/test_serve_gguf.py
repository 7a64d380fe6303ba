"""``kvstore engine --model FILE.gguf`` for real: SmolLM2-135M-Instruct's GGUF in a server
process, driven by the official openai client. Its chat template comes from the GGUF, the
answer is the model's, and the next turn's prompt is served from the cache. Under CI=true a
missing model fails (tests/factories.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.engine.checkpoint import SMOLLM2_FILE, SMOLLM2_INSTALL, smollm2_gguf

from factories import require
from serve_helpers import EngineServer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    path = smollm2_gguf()
    require(path, f"{SMOLLM2_FILE} is not installed ({SMOLLM2_INSTALL})")
    cache = tmp_path_factory.mktemp("models")
    proc = EngineServer("--host-mem", "256MiB", model=str(path), env={"KVSTORE_MODEL_CACHE": str(cache)})
    proc.cache = cache  # type: ignore[attr-defined]
    yield proc
    proc.stop()


def test_the_gguf_is_served_under_its_file_name_and_cached_once(server: EngineServer) -> None:
    (model,) = server.client().models.list().data
    assert model.id == "SmolLM2-135M-Instruct.Q4_1"
    entries = [p for p in Path(server.cache).iterdir() if p.is_dir()]  # type: ignore[attr-defined]
    assert len(entries) == 1 and (entries[0] / "chat_template.jinja").is_file()


def test_a_chat_is_answered_by_the_model_and_its_next_turn_hits_the_cache(server: EngineServer) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=messages,
                                           max_tokens=12, temperature=0)
    answer = first.choices[0].message.content
    assert "Paris" in answer, answer
    assert first.usage.prompt_tokens == 37  # the GGUF's template, with SmolLM's default system prompt
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=messages,
                                            max_tokens=12, temperature=0)
    assert "Rome" in second.choices[0].message.content, second.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens >= 32  # the first turn's full blocks


@pytest.mark.parametrize(("content", "message"), [
    (b"not a model at all", "is not a GGUF file"),
    (None, "truncated"),  # SmolLM2's first MiB: a GGUF header whose tensors run past the end
])
def test_a_bad_gguf_is_a_one_line_error_and_exit_2(content: bytes | None, message: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    if content is None:
        source = smollm2_gguf()
        require(source, f"{SMOLLM2_FILE} is not installed ({SMOLLM2_INSTALL})")
        assert source is not None
        with open(source, "rb") as fh:
            content = fh.read(1 << 20)
    path.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "engine", "--model", str(path), "--port", "0"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KVSTORE_MODEL_CACHE": str(tmp_path / "models")})
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("kvstore engine: ")
