"""Tiny Hugging Face checkpoints (random weights, saved and loaded back) and engine factories.

Models are built once per session: 2 layers, hidden 64, 4 query / 2 KV heads, vocab 128. The
Llama one uses llama3 RoPE scaling with a short original context, so the scaling matters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.engine import LLMEngine, SamplingParams

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2)
# prompts of mixed lengths: not multiples of the block size (4), a 1-token prompt, one over 8 blocks
PROMPTS = [[5], [9, 8, 7, 6, 5, 4, 3], list(range(10, 40)), [17, 3] * 4 + [99], list(range(60, 66))]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _save(model: Any, path: Path, **kwargs: Any) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    model = LlamaForCausalLM(LlamaConfig(**TINY, rope_parameters=rope)).eval()
    return model, _save(model, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def hf_qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True)).eval()
    # random init leaves the q/k/v biases at zero; make them matter
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model, _save(model, tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="session")
def llama_dir(hf_llama: tuple[Any, Path]) -> Path:
    return hf_llama[1]


def make_engine(model_dir: Path | None, **kwargs: Any) -> LLMEngine:
    """An engine with test-sized defaults: block 4, a 64-block pool, a 64-block host tier."""
    opts: dict[str, Any] = dict(block_size=4, dtype=torch.float32, kv_cache_bytes=64 * 2048,
                                host_bytes=64 * 4096, fetch_policy="always")
    opts.update(kwargs)
    return LLMEngine(None if model_dir is None else str(model_dir), **opts)


def hf_greedy_check(model: Any, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Teacher-forced HF logits over prompt + generated; asserts each generated token is HF's
    argmax (greedy equality by induction). Returns HF's logits for the prompt rows."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    expect = logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)].argmax(-1).tolist()
    assert generated == expect, f"prompt {prompt[:8]}...: engine {generated}, transformers {expect}"
    return logits[: len(prompt)]
