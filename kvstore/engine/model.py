"""The decoder over the paged KV pool: the Llama family (Llama incl. llama3 RoPE scaling, Qwen2,
Mistral) and Gemma 3, each layer full or sliding-window attention (its ``AttentionSpec``).

One forward runs a packed batch: the first ``num_decode`` rows are one new token per decoding
sequence, the rest are prefill chunks packed one sequence after another. Every layer writes its
new K/V into the pool (``kernels.store_kv``), then attends over the pool by block table; a
sliding layer only to the last ``window`` positions of each row's sequence (a mask, or the rows
cut to the window: the pool still holds every layer's rows of every block).

What a layer is in each family is kvstore/engine/families.py's; the model adds what the layers
share: the embedding (Gemma 3's scaled by sqrt(hidden_size)), RoPE per base (Gemma 3's sliding
layers have their own), the attention scale (Gemma 3's ``query_pre_attn_scalar ** -0.5``), the
final norm, and the logits (tied or not; Gemma's softcapping where its config sets one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstore import kernels
from kvstore.engine.attention import StepPlan, row_view
from kvstore.engine.checkpoint import AttentionSpec, CheckpointError, ModelConfig
from kvstore.engine.families import Layer, embed_scale
from kvstore.engine.layers import Linear, RMSNorm, RopeTables, can_prepack, rope_inv_freq, rotate, tied_logits


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


class LlamaModel:
    """Weights plus the forward pass, for every family the engine runs (the Llama family and
    Gemma 3, by ``config.model_type``); no KV state of its own (the pool is passed in).

    ``prepack``: keep the projections' weights in oneDNN's blocked layout where this torch and
    CPU can (``can_prepack``; ``self.prepacked`` says whether they are), a tied output projection
    included, as a packed copy beside the embedding (vocab x hidden more memory: 113 MB for
    SmolLM2 in float32).

    ``attention_specs`` (one per layer) and ``windows`` (the distinct windows, None for full
    attention) say what each layer's attention reads.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, prepack: bool = False) -> None:
        self.config = c = config
        self.prepacked = prepack = prepack and can_prepack(device, dtype)
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        try:
            self.embed = w.pop("model.embed_tokens.weight")
            self.norm = RMSNorm(w.pop("model.norm.weight"), c.rms_norm_eps, offset=c.is_gemma3)
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
        self.embed_scale = embed_scale(c, dtype)
        self.attention_specs: tuple[AttentionSpec, ...] = c.layer_specs
        self.windows: tuple[int | None, ...] = tuple(dict.fromkeys(s.window for s in self.attention_specs))
        self.layers = [Layer(w, f"model.layers.{i}.", c, spec, prepack) for i, spec in enumerate(self.attention_specs)]
        self.device, self.dtype = device, dtype
        self.scale = (c.query_pre_attn_scalar if c.query_pre_attn_scalar is not None else c.head_dim) ** -0.5
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        # RoPE per base: every layer's, or (Gemma 3) the full layers' and the sliding layers' own
        full = RopeTables(rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling), device, dtype)
        local = full if c.sliding_rope_theta is None else RopeTables(
            rope_inv_freq(c.head_dim, c.sliding_rope_theta, c.sliding_rope_scaling), device, dtype)
        self.ropes = [local if spec.window is not None else full for spec in self.attention_specs]
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
        tables = {id(rope): rope(positions, max_position) for rope in self.ropes}  # cos/sin once per base
        x = self.embed[input_ids]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        for i, layer in enumerate(self.layers):
            h = layer.attn_norm(x)
            qkv = layer.qkv(h)
            # q and k are adjacent columns of qkv: normed (Gemma 3) and rotated as one tensor of
            # num_heads + num_kv_heads heads (half the small ops of each apart; a one-row step is
            # mostly such ops)
            qk = qkv[:, : self.q_size + self.kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim)
            if layer.qk_norm is not None:
                qk = layer.qk_norm(qk)
            qk = rotate(qk, *tables[id(self.ropes[i])])
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(n, c.num_kv_heads, c.head_dim)
            window = layer.spec.window
            if batch.plan is not None:
                out = batch.plan.attend(q, k, v, *self._row_views(kv_pool, i), self.scale, kv_codes, window=window)
            else:
                out = self._kernel_attention(q, k, v, *self._kernel_views(kv_pool, i, kv_codes), batch, window)
            out = layer.o(out.view(n, self.q_size))
            x = x + (out if layer.attn_out_norm is None else layer.attn_out_norm(out))
            out = layer.mlp(layer.mlp_norm(x))
            x = x + (out if layer.mlp_out_norm is None else layer.mlp_out_norm(out))
        return self.norm(x)

    def _kernel_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None,
                          batch: AttentionBatch, window: int | None) -> torch.Tensor:
        """The new rows into the pool, then attention, through kernels/ (Triton on CUDA). A float
        pool of another dtype than the model's takes rows and queries in its own dtype."""
        if k_scales is None and k_cache.dtype != q.dtype:
            out = self._kernel_attention(q.to(k_cache.dtype), k.to(k_cache.dtype), v.to(k_cache.dtype), k_cache,
                                         v_cache, None, None, batch, window)
            return out.to(q.dtype)
        kernels.store_kv(k, v, k_cache, v_cache, batch.slot_mapping, k_scales=k_scales, v_scales=v_scales)
        out = torch.empty_like(q)
        d, n = batch.num_decode, q.shape[0]
        if d:
            kernels.paged_decode_attention(q[:d], k_cache, v_cache, batch.decode_block_tables,
                                           batch.decode_seq_lens, self.scale, out=out[:d], k_scales=k_scales,
                                           v_scales=v_scales, window=window)
        if d < n:
            kernels.paged_prefill_attention(q[d:], k_cache, v_cache, batch.prefill_block_tables,
                                            batch.prefill_seq_lens, batch.cu_seqlens_q, self.scale,
                                            out=out[d:], max_query_len=batch.max_query_len, k_scales=k_scales,
                                            v_scales=v_scales, window=window)
        return out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` (the projection, and a final softcapping, in the model
        dtype, like transformers)."""
        logits = tied_logits(hidden, self.embed) if self.lm_head is None else self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
