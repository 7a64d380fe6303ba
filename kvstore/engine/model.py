"""The Llama-family decoder (Llama incl. llama3 RoPE scaling, Qwen2, Mistral without sliding
window) over the paged KV pool: RMSNorm, RoPE, grouped-query attention, SwiGLU.

One forward runs a packed batch: the first ``num_decode`` rows are one new token per decoding
sequence, the rest are prefill chunks packed one sequence after another. Every layer writes its
new K/V into the pool (``kernels.store_kv``), then attends over the pool by block table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvstore import kernels
from kvstore.engine.attention import StepPlan, row_view
from kvstore.engine.checkpoint import CheckpointError, ModelConfig


@dataclass
class AttentionBatch:
    """Where a packed batch's rows live in the pool and what each row attends to.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 pool slot of each new row.
        num_decode: the first ``num_decode`` rows are decode rows, one per sequence.
        decode_block_tables, decode_seq_lens: their block tables and lengths (new token included).
        prefill_block_tables, prefill_seq_lens, cu_seqlens_q: the prefill sequences' tables,
            total lengths and row offsets (relative to the first prefill row).
        max_query_len: the longest prefill chunk.
        plan: on the torch path, the step's row ids and masks (kvstore/engine/attention.py); None: the
            layers call kernels/ with the tensors above.
    """

    slot_mapping: torch.Tensor
    num_decode: int
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_query_len: int
    plan: StepPlan | None = field(default=None)


def _rope_inv_freq(c: ModelConfig) -> torch.Tensor:
    dim = c.head_dim
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = c.rope_scaling
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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op; the same math as below
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Layer:
    """One decoder layer's weights, fused: q/k/v into one projection, gate/up into another."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, c: ModelConfig, prepack: bool) -> None:
        def take(name: str) -> torch.Tensor:
            try:
                return w.pop(prefix + name)
            except KeyError:
                raise CheckpointError(f"weight {prefix + name} is missing from the checkpoint") from None

        attn, mlp = "self_attn.", "mlp."
        self.input_norm = take("input_layernorm.weight")
        self.post_norm = take("post_attention_layernorm.weight")
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


class LlamaModel:
    """Weights plus the forward pass; no KV state of its own (the pool is passed in).

    ``prepack``: keep the projections' weights in oneDNN's blocked layout where this torch and
    CPU can (``can_prepack``; ``self.prepacked`` says whether they are), a tied output projection
    included, as a packed copy beside the embedding (vocab x hidden more memory: 113 MB for
    SmolLM2 in float32).
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, prepack: bool = False) -> None:
        self.config = c = config
        self.prepacked = prepack = prepack and can_prepack(device, dtype)
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        try:
            self.embed = w.pop("model.embed_tokens.weight")
            self.norm = w.pop("model.norm.weight")
        except KeyError as exc:
            raise CheckpointError(f"weight {exc.args[0]} is missing from the checkpoint") from None
        lm_head = w.pop("lm_head.weight", None)
        if lm_head is None and not c.tie_word_embeddings:
            raise CheckpointError("weight lm_head.weight is missing and tie_word_embeddings is false")
        # untied: a projection like the others; tied and not prepacked: the embedding's rows serve
        # both (no second copy of the vocabulary's weights)
        if lm_head is None and prepack:
            lm_head = self.embed
        self.lm_head = None if lm_head is None else Linear(lm_head, None, prepack)
        if tuple(self.embed.shape) != (c.vocab_size, c.hidden_size):
            raise CheckpointError(f"embed_tokens is {tuple(self.embed.shape)}, config implies "
                                  f"{(c.vocab_size, c.hidden_size)}")
        self.layers = [Layer(w, f"model.layers.{i}.", c, prepack) for i in range(c.num_layers)]
        self.device, self.dtype = device, dtype
        self.scale = c.head_dim ** -0.5
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self._inv_freq = _rope_inv_freq(c).to(device)
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows: tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def _kernel_views(self, kv_pool: torch.Tensor, layer: int, codes: torch.dtype | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Layer ``layer``'s ``(k_cache, v_cache, k_scales, v_scales)`` for the kernels: the pool's
        views, or for quantized pages the codes and scales viewing them (scales None otherwise)."""
        if codes is None:
            return kv_pool[:, layer, 0], kv_pool[:, layer, 1], None, None
        k_codes, k_scales = kernels.page_views(kv_pool[:, layer, 0], codes)
        v_codes, v_scales = kernels.page_views(kv_pool[:, layer, 1], codes)
        return k_codes, v_codes, k_scales, v_scales

    def _row_views(self, kv_pool: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V as one row per token slot (built once per pool)."""
        if self._rows is None or self._rows[0] != kv_pool.data_ptr():
            views = [(row_view(kv_pool[:, i, 0]), row_view(kv_pool[:, i, 1])) for i in range(kv_pool.shape[1])]
            self._rows = (kv_pool.data_ptr(), views)
        return self._rows[1][layer]

    def _rope_tables(self, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[positions, head_dim]`` in the model dtype, grown on demand."""
        if self._cos_sin is None or self._cos_sin[0].shape[0] < max_pos:
            size = max(max_pos, 2 * (0 if self._cos_sin is None else self._cos_sin[0].shape[0]), 256)
            pos = torch.arange(size, device=self.device, dtype=torch.float32)
            freqs = pos[:, None] * self._inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos_sin = (emb.cos().to(self.dtype), emb.sin().to(self.dtype))
        return self._cos_sin

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_pool: torch.Tensor, max_position: int, kv_codes: torch.dtype | None = None) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm, for a packed batch.

        ``kv_pool`` is ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``, or with
        ``kv_codes`` (int8, float8_e4m3fn) quantized pages, uint8 ``[..., head_dim + 2]``
        (kvstore/kernels/pages.py); the new rows' K/V are written into it at ``batch.slot_mapping``.
        """
        c = self.config
        n = input_ids.shape[0]
        cos_t, sin_t = self._rope_tables(max_position + 1)
        cos, sin = cos_t[positions][:, None, :], sin_t[positions][:, None, :]
        x = self.embed[input_ids]
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm, c.rms_norm_eps)
            qkv = layer.qkv(h)
            # q and k are adjacent columns of qkv: rotated as one tensor of num_heads + num_kv_heads
            # heads (half the small ops of rotating each; a one-row step is mostly such ops)
            qk = _rotate(qkv[:, : self.q_size + self.kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim),
                         cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(n, c.num_kv_heads, c.head_dim)
            if batch.plan is not None:
                out = batch.plan.attend(q, k, v, *self._row_views(kv_pool, i), self.scale, kv_codes)
            else:
                out = self._kernel_attention(q, k, v, *self._kernel_views(kv_pool, i, kv_codes), batch)
            x = x + layer.o(out.view(n, self.q_size))
            h = _rms_norm(x, layer.post_norm, c.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return _rms_norm(x, self.norm, c.rms_norm_eps)

    def _kernel_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None,
                          batch: AttentionBatch) -> torch.Tensor:
        """The new rows into the pool, then attention, through kernels/ (Triton on CUDA). A float
        pool of another dtype than the model's takes rows and queries in its own dtype."""
        if k_scales is None and k_cache.dtype != q.dtype:
            out = self._kernel_attention(q.to(k_cache.dtype), k.to(k_cache.dtype), v.to(k_cache.dtype), k_cache,
                                         v_cache, None, None, batch)
            return out.to(q.dtype)
        kernels.store_kv(k, v, k_cache, v_cache, batch.slot_mapping, k_scales=k_scales, v_scales=v_scales)
        out = torch.empty_like(q)
        d, n = batch.num_decode, q.shape[0]
        if d:
            kernels.paged_decode_attention(q[:d], k_cache, v_cache, batch.decode_block_tables,
                                           batch.decode_seq_lens, self.scale, out=out[:d], k_scales=k_scales,
                                           v_scales=v_scales)
        if d < n:
            kernels.paged_prefill_attention(q[d:], k_cache, v_cache, batch.prefill_block_tables,
                                            batch.prefill_seq_lens, batch.cu_seqlens_q, self.scale,
                                            out=out[d:], max_query_len=batch.max_query_len, k_scales=k_scales,
                                            v_scales=v_scales)
        return out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` (the projection runs in the model dtype, like HF)."""
        if self.lm_head is None:
            return tied_logits(hidden, self.embed).float()
        return self.lm_head(hidden).float()
