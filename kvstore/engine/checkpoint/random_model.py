"""The seeded random model: a small Llama with random weights for demos, tests and benchmarks
(``ModelConfig``'s defaults, with overrides), and its writing-out as a Hugging Face directory."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvstore.engine.checkpoint.types import Checkpoint, ModelConfig


def random_config(overrides: dict[str, Any] | None = None) -> ModelConfig:
    """The random model's hyperparameters: ``ModelConfig``'s defaults with ``overrides`` by field name."""
    return replace(ModelConfig(), **(overrides or {}))


def random_checkpoint(overrides: dict[str, Any] | None = None, seed: int = 0) -> Checkpoint:
    """A small Llama with seeded random weights (for demos and benchmarks); no tokenizer."""
    config = random_config(overrides)
    gen = torch.Generator().manual_seed(seed)
    c = config

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])

    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    weights = {"model.embed_tokens.weight": torch.randn((c.vocab_size, c.hidden_size), generator=gen),
               "model.norm.weight": torch.ones(c.hidden_size)}
    if not c.tie_word_embeddings:
        weights["lm_head.weight"] = rand(c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(c.hidden_size),
            p + "post_attention_layernorm.weight": torch.ones(c.hidden_size),
            p + "self_attn.q_proj.weight": rand(q_out, c.hidden_size),
            p + "self_attn.k_proj.weight": rand(kv_out, c.hidden_size),
            p + "self_attn.v_proj.weight": rand(kv_out, c.hidden_size),
            p + "self_attn.o_proj.weight": rand(c.hidden_size, q_out),
            p + "mlp.gate_proj.weight": rand(c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": rand(c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": rand(c.hidden_size, c.intermediate_size),
        })
    fingerprint = hashlib.sha256(json.dumps([sorted((overrides or {}).items()), seed], default=str).encode())
    return Checkpoint(config, weights, None, f"random:{fingerprint.hexdigest()[:16]}")


def save_random_checkpoint(path: str | os.PathLike[str], checkpoint: Checkpoint) -> None:
    """Write a random checkpoint as a Hugging Face directory (used by the benchmark's baseline)."""
    from safetensors.torch import save_file

    c = checkpoint.config
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in checkpoint.weights.items()}, str(root / "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "hidden_act": "silu", "torch_dtype": "float32",
    }
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
