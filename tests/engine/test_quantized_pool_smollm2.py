"""A quantized device pool on the real model, SmolLM2-135M-Instruct: perplexity of a text the
model was not trained on (this project's docs) and greedy agreement stay within bounds of the
float32 pool's. Agreement is teacher-forced: at each of the float32 pool's greedy tokens, whether
the quantized pool's model, given the same tokens before it, predicts the same one (a free-running
comparison counts every token after the first near-tie as different). Small sizes for CI;
``kvstore bench quality`` measures the headline figures and docs/storage-format.md holds them."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore.engine import LLMEngine, SamplingParams
from kvstore.engine.checkpoint import SMOLLM2_FILE, SMOLLM2_INSTALL, smollm2_gguf

from factories import require

ROOT = Path(__file__).resolve().parents[2]
TEXT_TOKENS = 512
# perplexity ratio to the float32 pool, and the share of greedy tokens equal to its, at least
BOUNDS = {"int8": (1.01, 0.95), "fp8": (1.04, 0.85)}


@pytest.fixture(scope="module")
def measured() -> Iterator[dict[str, tuple[float, list[int]]]]:
    """Per pool format: the text's perplexity, and the argmax at each position of the float32
    pool's greedy continuations (prompt + continuation scored in one pass)."""
    path = smollm2_gguf()
    require(path, f"{SMOLLM2_FILE} is not installed ({SMOLLM2_INSTALL})")
    text = (ROOT / "docs" / "eviction.md").read_text()
    found: dict[str, tuple[float, list[int]]] = {}
    scored: list[list[int]] = []
    for fmt in ("auto", "int8", "fp8"):
        with LLMEngine(str(path), kv_cache_dtype=fmt, kv_cache_bytes=64 << 20, host_bytes=0) as llm:
            ids = llm.tokenizer.encode(text).ids[:TEXT_TOKENS]
            if not scored:
                prompts = [ids[:160], ids[200:420]]
                outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
                scored = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
            logits = llm.generate([ids, *scored], SamplingParams(max_tokens=1, temperature=0.0, prompt_logits=True))
            assert all(o.prompt_logits is not None and o.prompt_logits_start == 0 for o in logits)
            text_logits = logits[0].prompt_logits
            nll = -torch.log_softmax(text_logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None]).mean()
            # row t predicts token t + 1: the rows before each continuation token
            picks = [int(t) for o in logits[1:] for t in o.prompt_logits[-33:-1].argmax(-1)]
            found[fmt] = (math.exp(float(nll)), picks)
    yield found


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_quantized_pool_keeps_perplexity_and_greedy_tokens_close(
        fmt: str, measured: dict[str, tuple[float, list[int]]]) -> None:
    ppl, picks = measured[fmt]
    base_ppl, base_picks = measured["auto"]
    max_ratio, min_agreement = BOUNDS[fmt]
    assert ppl / base_ppl <= max_ratio, (fmt, ppl, base_ppl)
    agreement = sum(a == b for a, b in zip(picks, base_picks, strict=True)) / len(picks)
    assert agreement >= min_agreement, (fmt, agreement)
