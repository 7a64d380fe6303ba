"""Tiny Hugging Face checkpoints (random weights, saved and loaded back) and engine factories.

Models are built once per session: 2 layers, hidden 64, 4 query / 2 KV heads, vocab 128. The
Llama one uses llama3 RoPE scaling with a short original context, so the scaling matters.

Sliding-window models (windows of 8-16 tokens, blocks of 4: ``SLIDING_PROMPTS`` are longer):
Mistral (every layer slides), Qwen2 (``use_sliding_window``, layers ``max_window_layers`` and up)
and Gemma 3 (its own layer kinds, norms, scale and RoPE bases, every weight that can matter
random: transformers initialises Gemma's norm weights to zero, which ``1 + w`` would hide).
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
# longer than the sliding windows below (but the first), not multiples of the block size (4)
SLIDING_PROMPTS = [[5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], list(range(10, 50)), [17, 3] * 9 + [99],
                   list(range(60, 83))]
GEMMA3_LAYERS = ["sliding_attention", "sliding_attention", "full_attention"] * 2


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
def hf_mistral_swa(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(4)
    model = MistralForCausalLM(MistralConfig(**TINY, head_dim=16, sliding_window=8)).eval()
    return model, _save(model, tmp_path_factory.mktemp("mistral-swa"))


@pytest.fixture(scope="session")
def hf_qwen2_swa(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    config = Qwen2Config(**{**TINY, "num_hidden_layers": 4}, tie_word_embeddings=True, use_sliding_window=True,
                         sliding_window=12, max_window_layers=2)
    assert config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model, _save(model, tmp_path_factory.mktemp("qwen2-swa"))


def gemma3(path: Path, seed: int = 6, **overrides: Any) -> tuple[Any, Path]:
    """A tiny Gemma 3 (6 layers, window 8, ``query_pre_attn_scalar`` 24 against a head_dim of 16)
    with random norms and a unit-scale embedding, saved to ``path``."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    options: dict[str, Any] = dict(TINY, num_hidden_layers=6, head_dim=16, sliding_window=8, pad_token_id=0,
                                   query_pre_attn_scalar=24, layer_types=GEMMA3_LAYERS)
    options.update(overrides)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**options)).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:  # zeros at init: (1 + w) would equal a plain RMSNorm's w = 1
                weight.normal_(0, 0.5)
        model.model.embed_tokens.weight.normal_(0, 1.0)  # logits of a few units, not hundredths
    return model, _save(model, path)


@pytest.fixture(scope="session")
def hf_gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    return gemma3(tmp_path_factory.mktemp("gemma3"))


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
