"""Run inside the fresh venv (not collected by pytest): the installed LLMEngine's greedy tokens
equal the installed transformers' on two tiny checkpoints, one saved by transformers
(``save_pretrained``, as tests/engine/conftest.py saves it) and one by kvstore
(``kvstore.tools.bench.tiny_llama``, the vLLM tests' model) and loaded by transformers.
Decode attention runs through the CPU kernel the installed package builds from its own source.
Prints one JSON line: the files both came from, the prompts checked, and whether the kernel ran."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import kvstore
from kvstore.engine import LLMEngine, SamplingParams
from kvstore.tools.bench.tiny_llama import save_tiny_llama

# tests/engine/conftest.py's TINY model and its llama3 RoPE with a short original context
TINY: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            bos_token_id=1, eos_token_id=2)
ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# mixed lengths: not multiples of the block size (4), a 1-token prompt, one over 8 blocks
PROMPTS = [[5], [9, 8, 7, 6, 5, 4, 3], list(range(10, 40)), [17, 3] * 4 + [99], list(range(60, 66))]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def transformers_greedy(model: Any, prompt: list[int], generated: list[int]) -> list[int]:
    """Teacher-forced argmax over prompt + generated: greedy equality by induction."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]
    return rows.argmax(-1).tolist()


def check(model_dir: Path, prompts: list[list[int]]) -> bool:
    """True when decode attention ran through the CPU kernel the installed package built."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLMEngine(str(model_dir), block_size=4, dtype=torch.float32, kv_cache_bytes=64 * 2048,
                    host_bytes=64 * 4096, fetch_policy="always")
    try:
        for prompt, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
            assert len(out.token_ids) == GREEDY.max_tokens, out
            expect = transformers_greedy(model, prompt, out.token_ids)
            assert out.token_ids == expect, (f"{model_dir.name} {prompt[:8]}: engine {out.token_ids}, "
                                             f"transformers {expect}")
        llm.check_integrity()
        return bool(llm.runner.row_kernel)
    finally:
        llm.close()


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        saved_by_transformers = Path(tmp) / "transformers-llama"
        model = LlamaForCausalLM(LlamaConfig(**TINY, rope_parameters=ROPE)).eval()
        model.save_pretrained(saved_by_transformers)
        kernel = check(saved_by_transformers, PROMPTS)
        saved_by_kvstore = save_tiny_llama(Path(tmp) / "tiny-llama")
        kernel &= check(saved_by_kvstore, [[t + 100 for t in p] for p in PROMPTS])
    print(json.dumps({"kvstore": kvstore.__file__, "transformers": transformers.__file__,
                      "prompts": len(PROMPTS), "row_kernel": kernel}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
