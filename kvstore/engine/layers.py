"""The decoder's building blocks, shared by every model family (kvstore/engine/families.py):
projections (``Linear``, on weights prepacked for oneDNN or kept transposed), the tied output
projection (``tied_logits``), RMSNorm (Llama's ``w`` or Gemma's ``1 + w``, and per head for q/k),
RoPE tables per base, and the gated MLP's activations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

PACK_ROWS = 64  # the row count oneDNN's blocked layout is chosen for: as fast at 1-32 rows as any other hint


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch can keep weights of ``dtype`` on ``device`` in oneDNN's blocked layout:
    on the CPU, float32 always (where torch has oneDNN), bfloat16 where the CPU has native bf16."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """``x @ weight.T + bias`` for ``x`` ``[rows, in]``.

    Prepacked (``prepack=True``, where ``can_prepack``): the weight is reordered once, here, into
    oneDNN's blocked layout, and each call runs oneDNN's product on it. That is what vLLM's CPU
    build does. On the 2-core EPYC, one SmolLM2 layer's four products took 0.60 against 1.03 ms at
    16 rows on two threads, 0.17 against 0.25 ms at one row (a product of one row on MKL does not
    use the second thread), and 1.08 against 1.56 ms at 16 rows on one thread; docs/engine.md.

    Otherwise the weight is kept transposed, ``[in, out]``, contiguous: both operands of the
    product are then row-major and so is the result. Of the three orientations on MKL this ran
    fastest at every row count the engine uses (``weight @ x.T`` took 1.3-2.1x and ``F.linear``
    1.2-2.6x as long at 16 rows on a 2-core Intel VM).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool = False) -> None:
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS) if prepack else None
        self.weight_t = None if prepack else weight.t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight_t is not None
        return x @ self.weight_t if self.bias is None else torch.addmm(self.bias, x, self.weight_t)


TIED_ROWS = 64  # up to this many rows, the tied projection runs as the vocabulary's rows against them


def tied_logits(hidden: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    """``hidden @ embed.T`` for an output projection tied to the embedding ``[vocab, hidden]``,
    without a transposed copy of the embedding.

    On the CPU, MKL runs ``embed @ hidden.T`` (the vocabulary's rows against a few columns)
    faster than ``F.linear`` at the row counts of decode steps, and a single row is padded to
    two, since one goes through a matrix-vector product that is slower still. SmolLM2's 49,152 x
    576 embedding, best of 30 on the 2-core EPYC: 1 row 5.4 against 8.8 ms on one thread (a
    decode step of one sequence runs on one: kvstore/engine/threads.py), 16 rows 15.1-15.8
    against 17.9-19.4 ms on two. From ``TIED_ROWS`` rows on, the transposed result's copy costs
    more than it saves, and ``F.linear`` runs instead.
    """
    rows = hidden.shape[0]
    if hidden.device.type != "cpu" or rows > TIED_ROWS or rows == 0:
        return F.linear(hidden, embed)
    columns = torch.cat([hidden, hidden]) if rows == 1 else hidden
    return (embed @ columns.T).T[:rows].contiguous()


class RMSNorm:
    """``x / rms(x)`` times a weight over the last dimension.

    Llama's weight is ``w``, and in float16/bfloat16 the normalised row is rounded to the model
    dtype before it is scaled. Gemma's (``offset=True``) is ``1 + w``, formed in float32 once
    here, and the row is scaled in float32 and rounded after, as transformers' Gemma3RMSNorm
    computes it. A weight of shape ``[heads, head_dim]`` (``HeadNorm``) scales each head's rows
    by its own row of it.
    """

    def __init__(self, weight: torch.Tensor, eps: float, offset: bool = False) -> None:
        self.eps, self.offset = eps, offset
        self.weight = 1.0 + weight.float() if offset else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dim() == 1:  # one fused op; the same math as below
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * self.weight).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def head_norm(q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float
              ) -> RMSNorm:
    """Gemma's q and k norms as one ``RMSNorm`` over ``[rows, num_heads + num_kv_heads, head_dim]``
    (q's heads, then k's: how the engine holds them, adjacent columns of the fused projection)."""
    weight = torch.cat([q_weight.expand(num_heads, -1), k_weight.expand(num_kv_heads, -1)])
    return RMSNorm(weight, eps, offset=True)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,  # SwiGLU (Llama, Qwen2, Mistral)
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),  # GeGLU (Gemma 3)
}


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """RoPE's inverse frequencies ``[head_dim / 2]`` for base ``theta`` and a scaling (None,
    ``linear``, or ``llama3``)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    blend = (old_len / wavelen - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, blended, scaled)


class RopeTables:
    """cos/sin ``[positions, head_dim]`` of one RoPE, in the model dtype, grown on demand."""

    def __init__(self, inv_freq: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        self.inv_freq, self.device, self.dtype = inv_freq.to(device), device, dtype
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``positions`` ``[n]``, as ``[n, 1, head_dim]`` (broadcast over heads)."""
        if self._cos_sin is None or self._cos_sin[0].shape[0] <= max_pos:
            size = max(max_pos + 1, 2 * (0 if self._cos_sin is None else self._cos_sin[0].shape[0]), 256)
            pos = torch.arange(size, device=self.device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos_sin = (emb.cos().to(self.dtype), emb.sin().to(self.dtype))
        cos, sin = self._cos_sin
        return cos[positions][:, None, :], sin[positions][:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in rotate-half form: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
