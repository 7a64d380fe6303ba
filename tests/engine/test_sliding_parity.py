"""Sliding-window models give transformers' greedy tokens and prompt logits (fp32, atol/rtol 1e-4)
on every path the engine has: Mistral (every layer slides, window 8), Qwen2 (the upper two of four
layers, window 12) and Gemma 3 (four of six layers, window 8), prompts up to 40 tokens in blocks
of 4, so every window matters. Paths: the torch path with and without the CPU decode kernel,
weights prepacked or not; chunked prefill (chunks cut across windows); a prefix cached in the
device pool and fetched back from host RAM (the prompt's rows after it computed over cached
blocks); and decoding groups over a shared prefix, which a sliding layer reads only inside its
window (kvstore/engine/read_plan.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import kvstore.engine.decode_parts as decode_parts
import kvstore.engine.read_plan as read_plan
from kvstore.engine import SamplingParams
from kvstore.engine.checkpoint import load_checkpoint
from kvstore.kernels import cpu_rows
from tests.engine.conftest import GREEDY, SLIDING_PROMPTS, hf_greedy_check, make_engine
from tests.factories import require

WITH_LOGITS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logits=True)
MODELS = ["hf_mistral_swa", "hf_qwen2_swa", "hf_gemma3"]
# the layers' windows (None: full attention)
WINDOWS = {"hf_mistral_swa": [8, 8], "hf_qwen2_swa": [None, None, 12, 12],
           "hf_gemma3": [8, 8, None, 8, 8, None]}


def hf_model(request: pytest.FixtureRequest, name: str) -> tuple[Any, Path]:
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


def check_outputs(model: Any, prompts: list[list[int]], outs: list[Any]) -> float:
    """Each output's tokens are transformers' greedy ones and its prompt logits (from the first
    row computed) equal transformers'; returns the largest logit difference."""
    worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        hf_logits = hf_greedy_check(model, prompt, out.token_ids)
        if out.prompt_logits is not None:
            start = out.prompt_logits_start
            assert out.prompt_logits.shape == hf_logits[start:].shape
            torch.testing.assert_close(out.prompt_logits, hf_logits[start:], atol=1e-4, rtol=1e-4)
            worst = max(worst, float((out.prompt_logits - hf_logits[start:]).abs().max()))
    return worst


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("prepack,row_kernel", [(True, True), (False, True), (True, False)],
                         ids=["prepacked-row-kernel", "plain-row-kernel", "prepacked-torch-attention"])
def test_sliding_models_match_transformers(name: str, prepack: bool, row_kernel: bool,
                                           request: pytest.FixtureRequest) -> None:
    model, path = hf_model(request, name)
    assert [s.window for s in load_checkpoint(path).config.layer_specs] == WINDOWS[name]
    require(not row_kernel or cpu_rows.load(), "the CPU decode kernel did not build")
    with make_engine(path, prepack_weights=prepack, cpu_decode_kernel=row_kernel) as llm:
        assert llm.runner.row_kernel == row_kernel
        assert llm.model.windows == tuple(dict.fromkeys(WINDOWS[name]))
        check_outputs(model, SLIDING_PROMPTS, llm.generate(SLIDING_PROMPTS, WITH_LOGITS))
        llm.check_integrity()


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_across_windows(name: str, request: pytest.FixtureRequest) -> None:
    model, path = hf_model(request, name)
    # 7-token chunks: a chunk's rows see windows that begin in earlier chunks' blocks
    with make_engine(path, max_num_batched_tokens=7) as llm:
        check_outputs(model, SLIDING_PROMPTS, llm.generate(SLIDING_PROMPTS, WITH_LOGITS))


@pytest.mark.parametrize("tier", ["device", "host"])
@pytest.mark.parametrize("name", MODELS)
def test_a_cached_prefix_gives_transformers_logits(name: str, tier: str, request: pytest.FixtureRequest) -> None:
    model, path = hf_model(request, name)
    prompts = [p for p in SLIDING_PROMPTS if len(p) > 8]
    reuse = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logits=True,
                           skip_reading_prefix_cache=False)
    # a pool that holds every block of both runs: no eviction or preemption, whose timing (the
    # write-through thread, a fetch's completion) would decide what hits and where a prompt's
    # first computed row (its logits' start) falls
    with make_engine(path, kv_cache_bytes=1 << 20) as llm:
        llm.generate(prompts, GREEDY)  # computed, cached in the pool, written through to host RAM
        if tier == "host":
            llm.evict_device_cache()
        outs = llm.generate(prompts, reuse)
        hits = [sum(out.metrics.cached_tokens.values()) for out in outs]
        for prompt, out, hit in zip(prompts, outs, hits, strict=True):
            # at most the full blocks (a prompt found whole still computes its last row); how much
            # a hybrid model's hit is, is the KV groups' reconciliation (kvstore/engine/groups.py)
            assert hit <= len(prompt) // 4 * 4 and hit % 4 == 0, out.metrics.cached_tokens
            assert out.prompt_logits_start == min(hit, len(prompt) - 1)
        assert sum(hits) >= 16, hits  # the rows after a hit were computed over cached blocks
        check_outputs(model, prompts, outs)
        llm.check_integrity()


@pytest.mark.parametrize("row_kernel", [False, True], ids=["torch-attention", "row-kernel"])
@pytest.mark.parametrize("name", MODELS)
def test_decoding_groups_read_a_sliding_layer_inside_its_window(name: str, row_kernel: bool,
                                                                 request: pytest.FixtureRequest,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """16 sequences over one 48-token prefix: full layers read it as one group; a sliding layer's
    group holds only the rows every member's window sees, each member's other window rows its
    own (``decode_parts.in_window``); tokens equal transformers' and a run without groups."""
    model, path = hf_model(request, name)
    require(not row_kernel or cpu_rows.load(), "the CPU decode kernel did not build")
    prefix = [(7 * i) % 120 + 3 for i in range(48)]
    prompts = [[*prefix, 10 + i] for i in range(16)]
    formed: dict[int | None, int] = {}
    real = read_plan.in_window

    def spy(groups: Any, lens: list[int], block_size: int, window: int | None) -> Any:
        kept = real(groups, lens, block_size, window)
        for members, first, _ in kept:
            assert window is None or all(n - window <= first for n in (lens[i] for i in members))
            formed[window] = max(formed.get(window, 0), len(members))
        return kept

    monkeypatch.setattr(read_plan, "in_window", spy)
    monkeypatch.setattr(decode_parts, "GROUP_MIN_ROWS", 16)  # groups of this tiny prefix pay
    with make_engine(path, cpu_decode_kernel=row_kernel) as llm:
        llm.generate([prefix], GREEDY)  # the prefix cached: the batch's tables start with its blocks
        together = llm.generate(prompts, GREEDY)
        assert set(formed) == set(WINDOWS[name]) and min(formed.values()) >= 8, formed
        monkeypatch.setattr(decode_parts, "GROUP_MIN_ROWS", 1 << 30)  # no groups
        apart = llm.generate(prompts, GREEDY)
        llm.check_integrity()
    assert [o.token_ids for o in together] == [o.token_ids for o in apart]
    check_outputs(model, prompts[:4], together[:4])
