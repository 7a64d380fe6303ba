"""The whole engine through the Triton kernels (on CPU under Triton's interpreter): same greedy
tokens and close prompt logits as through the reference kernels, with a float pool and with
quantized pages (int8, fp8), and with a sliding-window layer (window 8: both prompts are longer)
beside a full one. Slow; the smallest shapes the Triton kernels accept (block 16, head_dim 16),
one short prompt and one of two whole blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json, torch
from kvstore.engine import LLMEngine, SamplingParams
from kvstore.engine.checkpoint import AttentionSpec
import sys
layers = {} if sys.argv[2] == "none" else dict(
    num_layers=2, attention=(AttentionSpec("sliding_attention", int(sys.argv[2])), AttentionSpec()))
llm = LLMEngine(None, block_size=16, kv_cache_bytes=1 << 20, host_bytes=1 << 20, fetch_policy="always",
                kv_cache_dtype=sys.argv[1],
                random_model={**dict(num_layers=1, hidden_size=64, intermediate_size=64, num_heads=4,
                                     num_kv_heads=2, head_dim=16, vocab_size=64), **layers})
p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logits=True)
first = llm.generate([list(range(1, 21))], p)[0]
llm.evict_device_cache()
greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
again = llm.generate([list(range(1, 21))], greedy)[0]
# two whole blocks: found whole, its last token runs with slot -1 (store_kv skips it)
whole = llm.generate([list(range(1, 33))], greedy)[0]
llm.evict_device_cache()
whole_again = llm.generate([list(range(1, 33))], greedy)[0]
llm.close()
print(json.dumps({"triton": [m for m in ("decode_attention", "prefill_attention", "cache_write", "block_copy")
                             if f"kvstore.kernels.{m}" in sys.modules],
                  "tokens": first.token_ids, "again": again.token_ids, "host": again.metrics.cached_tokens["host"],
                  "whole": whole.token_ids, "whole_again": whole_again.token_ids,
                  "whole_host": whole_again.metrics.cached_tokens["host"],
                  "logits": first.prompt_logits.tolist()}))
"""


def run_engine(backend: str, kv_cache_dtype: str, window: int | None) -> dict:
    env = dict(os.environ, KVSTORE_KERNELS=backend, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, kv_cache_dtype, str(window).lower()], env=env,
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(("kv_cache_dtype", "window"), [("auto", None), ("int8", None), ("fp8", None), ("auto", 8),
                                                       ("int8", 8)])
def test_engine_through_triton_interpreter_matches_reference(kv_cache_dtype: str, window: int | None) -> None:
    pytest.importorskip("triton")
    import torch

    ref = run_engine("reference", kv_cache_dtype, window)
    tri = run_engine("triton", kv_cache_dtype, window)
    # a hybrid model's blocks move per KV group (kvstore/engine/groups.py), not through block_copy
    kernels = ["decode_attention", "prefill_attention", "cache_write"] + ["block_copy"] * (window is None)
    assert tri["triton"] == kernels and not ref["triton"]
    assert tri["tokens"] == ref["tokens"]
    assert tri["again"] == ref["tokens"] and tri["host"] == ref["host"]  # fetched back through scatter_blocks
    assert tri["whole"] == tri["whole_again"] == ref["whole"] == ref["whole_again"]
    assert tri["whole_host"] == ref["whole_host"]
    if window is None:  # (a hybrid model's hit is its KV groups' reconciliation: kvstore/engine/groups.py)
        assert tri["host"] == 16 and tri["whole_host"] == 32
    torch.testing.assert_close(torch.tensor(tri["logits"]), torch.tensor(ref["logits"]), atol=1e-4, rtol=1e-4)
