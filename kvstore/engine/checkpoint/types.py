"""The checkpoint package's shared types, at its bottom: ``CheckpointError``, ``ModelConfig`` (the
hyperparameters, normalised from a config.json dict) and ``Checkpoint`` (what a load returns).

Every reader above (Hugging Face directories, GGUF files, the random model, the model cache) and
the engine's model import these; this module imports nothing of kvstore.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

ARCHITECTURES = ("llama", "qwen2", "mistral")  # config.json model_type values the engine runs
ROPE_TYPES = ("default", "llama3", "linear")


class CheckpointError(ValueError):
    """The model directory is missing, incomplete or malformed (the message names the file)."""


def need_tokenizers() -> None:
    """Raise a CheckpointError naming the extra when the ``tokenizers`` package is missing (a
    checkpoint's tokenizer needs it; ``pip install kvstore`` alone, for the vLLM connector,
    does not bring it)."""
    import importlib.util

    if importlib.util.find_spec("tokenizers") is None:
        raise CheckpointError("reading a checkpoint's tokenizer needs the tokenizers package: "
                              "pip install 'kvstore[model]'")


@dataclass(frozen=True)
class ModelConfig:
    """The Llama-family hyperparameters the engine needs, normalised across config.json versions."""

    model_type: str = "llama"
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = field(default=())

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """Normalise a config.json dict (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``)."""
        model_type = cfg.get("model_type")
        if model_type not in ARCHITECTURES:
            raise CheckpointError(f"model_type {model_type!r} is not supported; supported: {list(ARCHITECTURES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (SwiGLU needs silu)")
        window = cfg.get("sliding_window")
        if window is not None and (model_type == "mistral" or cfg.get("use_sliding_window")):
            raise CheckpointError(f"sliding-window attention (sliding_window={window}) is not supported")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ROPE_TYPES:
                raise CheckpointError(f"rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
            eos: Any = (generation or {}).get("eos_token_id", cfg.get("eos_token_id"))
            eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=rope if rope_type != "default" else None,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"config.json is malformed: {type(exc).__name__}: {exc}") from None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"num_attention_heads={self.num_heads} is not a multiple of "
                                  f"num_key_value_heads={self.num_kv_heads}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass
class Checkpoint:
    """What a load returns: the config, the weights by Hugging Face name, a tokenizer, an id."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Any  # tokenizers.Tokenizer or None
    model_id: str
