"""Checkpoint loading: a Hugging Face directory (config.json, safetensors, generation_config.json,
tokenizer.json) or a GGUF file into a ModelConfig and a name -> tensor dict, or a seeded random model.

Nothing is downloaded: ``model`` is always a local directory or file. A GGUF is read through its
converted copy, a Hugging Face directory in the model cache (``kvstore.engine.model_cache``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = ("llama", "qwen2", "mistral")
ROPE_TYPES = ("default", "llama3", "linear")


class CheckpointError(ValueError):
    """The model directory is missing, incomplete or malformed (the message names the file)."""


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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = [root / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {root}")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"weight shard {f} is missing")
    return files


def checkpoint_dir(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The Hugging Face directory a model path is read from: the path itself, or for a GGUF file
    its converted copy (built on the first call; see ``kvstore.engine.model_cache``).

    Raises:
        CheckpointError: a missing path, or a file that is not a readable GGUF of a supported model.
    """
    root = Path(path)
    if root.is_dir():
        return root
    if not root.exists():
        raise CheckpointError(f"model {root} does not exist (a model is a Hugging Face checkpoint "
                              "directory or a .gguf file)")
    from kvstore.engine.model_cache import convert_gguf

    return convert_gguf(root, cache_dir).path


def load_checkpoint(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Checkpoint:
    """Read a checkpoint directory, or a GGUF file, into CPU tensors (in the file's dtype; a
    quantized GGUF's tensors dequantized to float32).

    Args:
        path: a Hugging Face checkpoint directory or a .gguf file.
        cache_dir: where GGUF files' converted copies are kept (default
            ``kvstore.engine.model_cache.default_cache_dir()``).

    Raises:
        CheckpointError: the directory, config.json or a weight shard is missing or malformed; a
            file that is not a GGUF, a truncated GGUF, or one of an architecture the engine lacks.
    """
    src = Path(path)
    if src.is_file():
        from kvstore.engine.model_cache import convert_gguf

        copy = convert_gguf(src, cache_dir)
        return _load_dir(copy.path, f"{src.stem}:{copy.sha256[:16]}")
    return _load_dir(checkpoint_dir(src), None)


def read_model_config(path: str | os.PathLike[str] | None, random_model: dict[str, Any] | None = None) -> ModelConfig:
    """A model's hyperparameters without its weights (sizing a KV pool before loading it): a
    checkpoint directory's or a GGUF's (converting it once, as loading would), or the random
    model's with ``random_model``'s overrides when ``path`` is None.

    Raises:
        CheckpointError: as ``load_checkpoint``.
    """
    if path is None:
        return replace(ModelConfig(), **(random_model or {}))
    return _read_config(checkpoint_dir(path))


def _read_config(root: Path) -> ModelConfig:
    if not (root / "config.json").is_file():
        ggufs = sorted(p.name for p in root.glob("*.gguf"))
        hint = f" (it holds {', '.join(ggufs)}: pass the .gguf file itself)" if ggufs else ""
        raise CheckpointError(f"{root} has no config.json{hint}")
    gen_path = root / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else None
    return ModelConfig.from_hf(_read_json(root / "config.json"), generation)


def _load_dir(root: Path, model_id: str | None) -> Checkpoint:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = _read_config(root)
    digest = hashlib.sha256((root / "config.json").read_bytes())
    weights: dict[str, torch.Tensor] = {}
    for f in _weight_files(root):
        try:
            weights.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read weights {f.name}: {exc}") from None
        with open(f, "rb") as fh:  # header + the first weights: different random models differ here
            digest.update(fh.read(1 << 16))
    tokenizer = None
    if (root / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as exc:  # the tokenizers library raises plain Exception subclasses
            raise CheckpointError(f"cannot read tokenizer.json: {exc}") from None
    return Checkpoint(config, weights, tokenizer, model_id or f"{root.name}:{digest.hexdigest()[:16]}")


def random_checkpoint(overrides: dict[str, Any] | None = None, seed: int = 0) -> Checkpoint:
    """A small Llama with seeded random weights (for demos and benchmarks); no tokenizer."""
    config = replace(ModelConfig(), **(overrides or {}))
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
