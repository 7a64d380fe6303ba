"""The checkpoint package's shared types, at its bottom: ``CheckpointError``, ``AttentionSpec`` (what
one layer's attention reads), ``ModelConfig`` (the hyperparameters, normalised from a config.json
dict by ``ModelConfig.from_hf``) and ``Checkpoint`` (what a load returns).

Every reader above (Hugging Face directories, GGUF files, the random model, the model cache) and
the engine's model import these; this module imports nothing of kvstore.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

ARCHITECTURES = ("llama", "qwen2", "mistral", "gemma3_text")  # config.json model_type values the engine runs
ROPE_TYPES = ("default", "llama3", "linear")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # SwiGLU's gate, GeGLU's (gelu with the tanh approximation)
# transformers' names of the layer kinds the engine runs (config.json's layer_types)
FULL, SLIDING = "full_attention", "sliding_attention"
# model types the engine refuses, with what it lacks for them (the message's reason)
LACKS = {
    "gpt_oss": "attention sinks", "qwen3_next": "linear attention layers", "qwen3_5": "linear attention layers",
    "qwen3_5_text": "linear attention layers", "falcon_h1": "Mamba2 layers", "granitemoehybrid": "Mamba2 layers",
    "nemotron_h": "Mamba2 layers", "jamba": "Mamba layers", "mamba": "Mamba layers", "mamba2": "Mamba2 layers",
    "lfm2": "short convolution layers", "llama4": "chunked attention", "llama4_text": "chunked attention",
    "gemma2": "attention logit softcapping", "gemma3": "a vision tower: give it the text model, gemma3_text",
}
# more layers than this is a corrupt or malicious count (the deepest models have ~130), refused
# before a list of one entry per layer is built
MAX_LAYERS = 4096
# Gemma 3's defaults where its config.json leaves a key out (transformers' Gemma3TextConfig)
_GEMMA3 = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256,
           "sliding_window": 4096, "sliding_window_pattern": 6}


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
class AttentionSpec:
    """What one layer's attention reads: every earlier position (``FULL``), or the last
    ``window`` positions (``SLIDING``): a query at position p sees keys at p - window < q <= p,
    its own included, as transformers' sliding-window mask does."""

    kind: str = FULL
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kind == FULL and self.window is not None:
            raise CheckpointError(f"a {FULL} layer has no window, got {self.window}")
        if self.kind == SLIDING and (self.window is None or self.window < 1):
            raise CheckpointError(f"a {SLIDING} layer needs a window of at least 1 token, got {self.window}")
        if self.kind not in (FULL, SLIDING):
            raise CheckpointError(f"layer kind {self.kind!r} is not one the engine runs ({FULL}, {SLIDING})")


@dataclass(frozen=True)
class ModelConfig:
    """The hyperparameters the engine needs, normalised across config.json versions.

    ``attention`` holds one ``AttentionSpec`` per layer (empty: every layer full); ``layer_specs``
    is that list whole. Gemma 3 (``model_type`` "gemma3_text") also sets ``hidden_act`` (GeGLU),
    ``query_pre_attn_scalar`` (the attention scale is its ``** -0.5``), its sliding layers' own
    RoPE (``sliding_rope_theta``, ``sliding_rope_scaling``) and ``final_logit_softcapping``.
    """

    model_type: str = "llama"
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # full layers' (every layer's without sliding_rope_theta)
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = field(default=())
    hidden_act: str = "silu"
    attention: tuple[AttentionSpec, ...] = field(default=())
    query_pre_attn_scalar: float | None = None  # None: head_dim
    sliding_rope_theta: float | None = None  # None: rope_theta and rope_scaling
    sliding_rope_scaling: dict[str, Any] | None = None
    final_logit_softcapping: float | None = None

    @property
    def layer_specs(self) -> tuple[AttentionSpec, ...]:
        """One ``AttentionSpec`` per layer."""
        return self.attention or (AttentionSpec(),) * self.num_layers

    @property
    def is_gemma3(self) -> bool:
        return self.model_type == "gemma3_text"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """Normalise a config.json dict (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``).

        Raises:
            CheckpointError: a model type, layer kind, activation or RoPE type the engine lacks
                (one line naming it), or a malformed config.
        """
        model_type = cfg.get("model_type")
        check_layer_kinds(cfg.get("layer_types"), model_type)
        if model_type not in ARCHITECTURES:
            reason = f" ({LACKS[model_type]})" if model_type in LACKS else ""
            raise CheckpointError(f"model_type {model_type!r} is not supported{reason}; "
                                  f"supported: {list(ARCHITECTURES)}")
        gemma = model_type == "gemma3_text"
        act = cfg.get("hidden_activation" if gemma else "hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        if act not in ACTIVATIONS:
            raise CheckpointError(f"hidden activation {act!r} is not supported; supported: {list(ACTIVATIONS)}")
        for refused in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if cfg.get(refused):
                raise CheckpointError(f"{model_type} with {refused}={cfg[refused]!r} is not supported")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            num_layers = int(cfg["num_hidden_layers"])
            if not 0 < num_layers <= MAX_LAYERS:
                raise CheckpointError(f"num_hidden_layers={num_layers} is out of range: 1 to {MAX_LAYERS}")
            theta, scaling, local_theta, local_scaling = _rope(cfg, gemma)
            eos: Any = (generation or {}).get("eos_token_id", cfg.get("eos_token_id"))
            eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
            softcap = cfg.get("final_logit_softcapping")
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
                qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                eos_token_ids=eos_ids,
                hidden_act=act,
                attention=layer_attention(cfg, model_type, num_layers),
                query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", _GEMMA3["query_pre_attn_scalar"]))
                if gemma else None,
                sliding_rope_theta=local_theta,
                sliding_rope_scaling=local_scaling,
                final_logit_softcapping=None if softcap is None else float(softcap),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"config.json is malformed: {type(exc).__name__}: {exc}") from None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_layers > MAX_LAYERS:
            raise CheckpointError(f"num_layers={self.num_layers} is out of range: 1 to {MAX_LAYERS}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"num_attention_heads={self.num_heads} is not a multiple of "
                                  f"num_key_value_heads={self.num_kv_heads}")
        if self.attention and len(self.attention) != self.num_layers:
            raise CheckpointError(f"{len(self.attention)} layer attention specs for {self.num_layers} layers")
        if self.hidden_act not in ACTIVATIONS:
            raise CheckpointError(f"hidden activation {self.hidden_act!r} is not supported; "
                                  f"supported: {list(ACTIVATIONS)}")


def check_layer_kinds(layer_types: Any, model_type: Any) -> None:
    """Refuse, in one line naming it, a layer kind the engine lacks (linear attention, Mamba,
    chunked attention, ...) in a config.json's ``layer_types``."""
    if layer_types is None:
        return
    if not isinstance(layer_types, list):
        raise CheckpointError(f"config.json is malformed: layer_types is {layer_types!r}, not a list")
    for i, kind in enumerate(layer_types):
        if kind not in (FULL, SLIDING):
            raise CheckpointError(f"model_type {model_type!r}: layer {i} is {kind!r}, a layer kind the engine "
                                  f"lacks (it runs {FULL} and {SLIDING} layers)")


def layer_attention(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[AttentionSpec, ...]:
    """Each layer's attention, by transformers 5.25's rule for its model type (empty: all full).

    - mistral: every layer slides when ``sliding_window`` is set (its ``layer_types`` is ignored);
    - qwen2: only with ``use_sliding_window``; then the layers listed sliding in ``layer_types``,
      or without that list layers ``max_window_layers`` and up;
    - gemma3_text: ``layer_types``, or without it every ``sliding_window_pattern``-th layer full
      (layers 5, 11, 17, ... for the default 6), the others sliding;
    - llama: every layer full.
    """
    window = cfg.get("sliding_window")
    if model_type == "mistral":
        kinds = [SLIDING if window is not None else FULL] * num_layers
    elif model_type == "qwen2":
        if not cfg.get("use_sliding_window"):
            window = None
        first = int(cfg.get("max_window_layers", 28))
        kinds = cfg.get("layer_types") or [SLIDING if window is not None and i >= first else FULL
                                           for i in range(num_layers)]
    elif model_type == "gemma3_text":
        window = cfg.get("sliding_window", _GEMMA3["sliding_window"])
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                      or _GEMMA3["sliding_window_pattern"])
        kinds = cfg.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    else:
        return ()
    if len(kinds) != num_layers:
        raise CheckpointError(f"config.json is malformed: layer_types has {len(kinds)} entries for "
                              f"{num_layers} layers")
    if SLIDING not in kinds:
        return ()
    if window is None:
        raise CheckpointError(f"{model_type}: layer_types names {SLIDING} layers but no sliding_window is set")
    return tuple(AttentionSpec(SLIDING, int(window)) if k == SLIDING else AttentionSpec() for k in kinds)


def _rope(cfg: dict[str, Any], gemma: bool) -> tuple[float, dict[str, Any] | None, float | None,
                                                      dict[str, Any] | None]:
    """``(theta, scaling, sliding_theta, sliding_scaling)``: full layers' RoPE, and sliding
    layers' where they have their own (Gemma 3: ``rope_parameters`` per layer kind in
    transformers 5, ``rope_local_base_freq`` in 4.x); scaling None for the default type."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    default_theta = _GEMMA3["rope_theta"] if gemma else 10000.0
    if FULL in params or SLIDING in params:  # transformers 5: one entry per layer kind
        theta, scaling = _rope_entry(params.get(FULL) or {}, cfg.get("rope_theta", default_theta))
        local = params.get(SLIDING) or {}
        local_theta, local_scaling = _rope_entry(local, cfg.get("rope_local_base_freq", _GEMMA3["rope_local_base_freq"]))
        return theta, scaling, local_theta, local_scaling
    theta, scaling = _rope_entry(params, cfg.get("rope_theta", default_theta))
    if not gemma:
        return theta, scaling, None, None
    # transformers 4.x Gemma 3: rope_scaling is the full layers' alone; the local base has no scaling
    return theta, scaling, float(cfg.get("rope_local_base_freq", _GEMMA3["rope_local_base_freq"])), None


def _rope_entry(params: dict[str, Any], default_theta: Any) -> tuple[float, dict[str, Any] | None]:
    theta = float(params.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
    return theta, (dict(params) if rope_type != "default" else None)


@dataclass
class Checkpoint:
    """What a load returns: the config, the weights by Hugging Face name, a tokenizer, an id."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Any  # tokenizers.Tokenizer or None
    model_id: str
