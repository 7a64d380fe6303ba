"""What one decoder layer is in each model family the engine runs: its weights by Hugging Face
name, fused (q/k/v into one projection, gate/up into another), its norms and its activation.

- Llama, Qwen2, Mistral: a norm before attention and one before the MLP (Llama's RMSNorm, ``w``),
  SwiGLU; Qwen2 with q/k/v biases.
- Gemma 3 (``gemma3_text``): four norms a layer (before and after attention, before and after the
  MLP), each ``1 + w``; q and k normed per head (``1 + w`` over head_dim) before RoPE; GeGLU
  (gelu with the tanh approximation). What else differs (the embedding scaled by
  sqrt(hidden_size), the attention scale, two RoPE bases, final logit softcapping) is the
  model's (kvstore/engine/model.py).

Every layer also carries its ``AttentionSpec`` (full, or sliding with its window): the one place
a layer's kind is read from.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstore.engine.checkpoint import AttentionSpec, CheckpointError, ModelConfig
from kvstore.engine.layers import ACTIVATIONS, Linear, RMSNorm, head_norm


class Layer:
    """One decoder layer's weights, fused, and its attention's spec.

    ``attn_norm`` and ``mlp_norm`` normalise the residual stream before attention and before the
    MLP; ``attn_out_norm`` and ``mlp_out_norm`` (Gemma 3; None otherwise) normalise each one's
    output before it is added back; ``qk_norm`` (Gemma 3) normalises q's and k's heads.
    """

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, c: ModelConfig, spec: AttentionSpec,
                 prepack: bool) -> None:
        def take(name: str) -> torch.Tensor:
            try:
                return w.pop(prefix + name)
            except KeyError:
                raise CheckpointError(f"weight {prefix + name} is missing from the checkpoint") from None

        gemma = c.is_gemma3
        attn, mlp = "self_attn.", "mlp."
        self.spec = spec
        self.act: Callable[[torch.Tensor], torch.Tensor] = ACTIVATIONS[c.hidden_act]
        eps = c.rms_norm_eps
        self.attn_norm = RMSNorm(take("input_layernorm.weight"), eps, offset=gemma)
        if gemma:
            self.attn_out_norm: RMSNorm | None = RMSNorm(take("post_attention_layernorm.weight"), eps, offset=True)
            self.mlp_norm = RMSNorm(take("pre_feedforward_layernorm.weight"), eps, offset=True)
            self.mlp_out_norm: RMSNorm | None = RMSNorm(take("post_feedforward_layernorm.weight"), eps, offset=True)
            self.qk_norm: RMSNorm | None = head_norm(take(attn + "q_norm.weight"), take(attn + "k_norm.weight"),
                                                     c.num_heads, c.num_kv_heads, eps)
        else:
            self.attn_out_norm = self.mlp_out_norm = self.qk_norm = None
            self.mlp_norm = RMSNorm(take("post_attention_layernorm.weight"), eps)
        qkv = torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"])
        expected = ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size)
        if tuple(qkv.shape) != expected:
            raise CheckpointError(f"{prefix}self_attn q/k/v weights have {tuple(qkv.shape)} rows x cols, "
                                  f"config implies {expected}")
        self.qkv = Linear(qkv, torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"]) if c.qkv_bias else None,
                          prepack)
        self.o = Linear(take(attn + "o_proj.weight"), w.pop(prefix + attn + "o_proj.bias", None), prepack)
        self.gate_up = Linear(torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]),
                              torch.cat([take(mlp + "gate_proj.bias"), take(mlp + "up_proj.bias")])
                              if c.mlp_bias else None, prepack)
        self.down = Linear(take(mlp + "down_proj.weight"), take(mlp + "down_proj.bias") if c.mlp_bias else None,
                           prepack)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The gated MLP: ``down(act(gate(h)) * up(h))``."""
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


def embed_scale(c: ModelConfig, dtype: torch.dtype) -> torch.Tensor | None:
    """What the embedding's rows are multiplied by: Gemma 3's sqrt(hidden_size), held in the model
    dtype as transformers holds it (a float32 scalar cast to the weights' dtype: in bfloat16,
    sqrt(640) = 25.30 becomes 25.25); None for the Llama family."""
    if not c.is_gemma3:
        return None
    return torch.tensor(c.hidden_size**0.5, dtype=torch.float32).to(dtype)
