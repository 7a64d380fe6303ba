"""The engine's attention on the torch path: one gather plan per step, shared by every layer.

With Triton (CUDA, or ``KVSTORE_KERNELS=triton``) the model calls ``kernels/`` directly. On
the torch path the kernels' references rebuild their index tensors, masks and input checks
in each of the model's layers, although a step's block tables are the same for all of them;
at decode sizes that per-call work costs more than the attention. ``StepPlan`` builds them
once per step, and each layer is then an ``index_copy_`` (new K/V into the pool), an
``index_select`` (the sequences' rows out of it) and ``scaled_dot_product_attention``.
``tests/engine/test_model_parity.py`` holds the result to transformers.

Decoding sequences that share a cached prefix (a system prompt, a conversation's history, a
document several questions ask about) form groups (``shared_prefixes``): a group's shared rows
are read once per layer and attended by all of its queries in one call, each sequence's own
rows in another, and the two parts merge by the CPU flash kernel's log-sum-exps. Without that
each sequence copied the whole prefix out of the pool: 32 sequences over a 1,024-token prefix
took 830 ms a step on SmolLM2, two thirds of it in ``index_select``; grouped, 96 ms. Decoding
sequences whose own rows differ by more than 2x attend in separate calls (``by_length``), so
that one long sequence outside any group does not pad every other one to its length: served
at 32 concurrent requests, the engine's TPOT went from 400-500 ms to about 200.

With a float32 pool the runner usually enables the CPU decode kernel (``row_kernel``;
kvstore/kernels/cpu_rows.py): decode attention then reads the rows where they lie in the pool,
every decoding sequence and every group in one call a layer, each query's shared and own rows
under one softmax; its index tensors are built once a step. Prefill chunks, and decode without
the kernel, take the path above.

Sliding-window layers (Mistral, Qwen2's upper layers, five of Gemma 3's six) read only their
window: ``StepPlan`` holds one ``ReadPlan`` (kvstore/engine/read_plan.py) per window the model's
layers have, each with its own rows, masks, groups and kernel index, and a layer attends
through its window's. The pool keeps every layer's rows of every block (one block table per
sequence); what a sliding layer never reads is only not read.

Rows: a layer's K view ``pool[:, layer, 0]`` is ``[num_blocks, block_size, kv_heads, head_dim]``
with block stride ``pool.stride(0)``; seen as one row per token slot (``row_view``), slot
``b * block_size + o`` is row ``b * rows_per_block + o``, the same row id in every layer.

Quantized pages (``kv_codes`` int8 or fp8; kvstore/kernels/pages.py): a row is a token's
``[kv_heads, head_dim + 2]`` bytes of codes and scales. The new rows are quantized as they are
written; the rows a step reads are decoded right after their ``index_select``, which copies
them anyway (the float path copies the same rows): no page is decoded whole, and what the
attention sees is exactly the reference kernels' decoded values. A prefill chunk with no cached
context attends to its new K/V as the pool holds them (decoded pages, or a float pool's own
dtype), as the kernels do, which read every key through the block table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from kvstore import kernels
from kvstore.engine.decode_parts import grouped, merge, shared_prefixes
from kvstore.engine.read_plan import ReadPlan
from kvstore.kernels import cpu_rows, pack_rows, unpack_rows


def use_torch_path(device: torch.device) -> bool:
    """True where ``kernels`` would run its torch reference (the dispatcher's rule)."""
    backend = kernels.kernel_backend()
    return backend == "reference" or (backend == "auto" and device.type != "cuda")


# Query rows per call of a prefill chunk longer than its sliding window (``banded``)
BAND_TILE = 64


def banded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, window: int | None, scale: float,
           gqa: bool) -> torch.Tensor:
    """Attention of ``q`` ``[1, heads, n, head_dim]`` over ``k``/``v`` (``n`` rows each) under the
    additive band ``bias`` ``[n, n]`` (each row over its last ``window`` rows), ``BAND_TILE`` query
    rows a call, each over only the keys of its rows' windows (``bias`` sliced). One masked call
    over the whole band scores every pair of rows: a 1,056-row chunk under Gemma 3's window of
    512 took 25.0 ms a layer that way on the 2-core EPYC, 12.8 ms in tiles (best of 5)."""
    assert window is not None
    n = q.shape[2]
    out = q.new_empty((*q.shape[:3], v.shape[3]))
    for s in range(0, n, BAND_TILE):
        e, lo = min(n, s + BAND_TILE), max(0, s - window + 1)
        out[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, lo:e], v[:, :, lo:e],
                                                        attn_mask=bias[s:e, lo:e], scale=scale, enable_gqa=gqa)
    return out


def row_view(cache: torch.Tensor) -> torch.Tensor:
    """One layer's K or V view as ``[rows, kv_heads, head_dim]``, one row per token slot."""
    num_blocks, block_size, heads, dim = cache.shape
    row = cache.stride(1)
    assert cache.stride(2) == dim and cache.stride(3) == 1 and cache.stride(0) % row == 0
    return cache.as_strided(((num_blocks - 1) * (cache.stride(0) // row) + block_size, heads, dim), (row, dim, 1))


class StepPlan:
    """Row ids and masks of one step's packed batch (decode rows first, then prefill chunks).

    Args:
        slots: ``[num_tokens]`` pool slot of each new row; -1: the row's K/V are in the pool
            already and are not written (the last token of a prompt found whole in the cache).
        decode_tables, decode_lens: each decoding sequence's block table and length (new token
            included).
        prefill: per prefill chunk ``(block_table, seq_len, num_new)``, in packing order.
        block_size, rows_per_block: the pool's geometry (``pool.stride(0) // row``).
        row_kernel: decode attention through ``kvstore.kernels.cpu_rows`` (CPU, float32 pool
            and queries): the rows read in place, one call a layer for every decoding sequence
            (each its own length, no padding) and every shared-prefix group.
        windows: the attention windows of the model's layers (None: full attention); each gets
            its ``ReadPlan`` (kvstore/engine/read_plan.py), built once here for all its layers.
    """

    def __init__(self, slots: torch.Tensor, decode_tables: list[list[int]], decode_lens: list[int],
                 prefill: list[tuple[list[int], int, int]], block_size: int, rows_per_block: int,
                 device: torch.device, row_kernel: bool = False,
                 windows: Iterable[int | None] = (None,)) -> None:
        self.block_size, self.rows_per_block = block_size, rows_per_block
        keep = slots >= 0
        # store_rows: where the written rows go; store_sel: which rows of k/v are written (None: all)
        self.store_sel: torch.Tensor | None = None
        if bool(keep.all()):
            self.store_rows = self._rows(slots).to(device)
        else:
            self.store_sel = keep.nonzero().flatten().to(device)
            self.store_rows = self._rows(slots[keep]).to(device)
        self.num_decode = len(decode_lens)
        # decoding sequences whose tables begin alike, once for every window; merging a group's
        # part into its members' needs the CPU flash kernel's log-sum-exp (none on CUDA)
        groups = shared_prefixes(decode_tables, decode_lens, block_size) if device.type == "cpu" else None
        self.reads = {window: ReadPlan(decode_tables, decode_lens, groups, prefill, block_size, rows_per_block,
                                       device, row_kernel, window) for window in dict.fromkeys(windows)}

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        return (slots // self.block_size) * self.rows_per_block + slots % self.block_size

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor,
               v_rows: torch.Tensor, scale: float, codes: torch.dtype | None = None,
               window: int | None = None) -> torch.Tensor:
        """Write the step's new ``k``/``v`` ``[n, kv_heads, head_dim]`` into one layer's row views
        (quantized pages' rows when ``codes`` names their code dtype) and return the attention
        output ``[n, num_heads, head_dim]`` of ``q``, each row over the last ``window`` positions
        of its sequence (None: all of them)."""
        plan = self.reads[window]
        sel = self.store_sel
        if codes is not None:  # K and V quantized in one pass (half the small ops of a step's layer)
            kv_new = pack_rows(torch.cat((k, v), dim=1), codes)
            k_new, v_new = kv_new[:, : k.shape[1]], kv_new[:, k.shape[1] :]
        else:  # a float pool of another dtype than the model's (kv_cache_dtype) stores rounded rows
            k_new, v_new = k.to(k_rows.dtype), v.to(v_rows.dtype)
        if sel is None:
            k_rows.index_copy_(0, self.store_rows, k_new)
            v_rows.index_copy_(0, self.store_rows, v_new)
        elif sel.numel():
            k_rows.index_copy_(0, self.store_rows, k_new.index_select(0, sel))
            v_rows.index_copy_(0, self.store_rows, v_new.index_select(0, sel))

        def stored(rows: torch.Tensor) -> torch.Tensor:
            """Rows as the pool holds them, as values (decoded pages; a float pool's own dtype)."""
            return rows if codes is None else unpack_rows(rows, codes)

        def read(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return stored(rows.index_select(0, ids))

        num_heads, head_dim = q.shape[1:]
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        # fp16/bf16 attend in float32, like the kernels' references (decoded pages are float32)
        up = q.dtype != torch.float32 or codes is not None or k_rows.dtype != q.dtype
        out = torch.empty_like(q)
        d = self.num_decode
        if d:
            # the `group` query heads of one KV head become `group` query rows of that head
            queries = q[:d].reshape(d, num_kv_heads, group, head_dim)
            if up:
                queries = queries.float()
            if plan.row_index is not None:
                attn = cpu_rows.row_attention(queries.contiguous(), k_rows, v_rows, *plan.row_index, scale)
            elif len(plan.decode_parts) == 1 and not plan.decode_groups:
                part = plan.decode_parts[0]
                keys = read(k_rows, part.rows).view(d, part.length, num_kv_heads, head_dim)
                values = read(v_rows, part.rows).view(d, part.length, num_kv_heads, head_dim)
                if up:
                    keys, values = keys.float(), values.float()
                attn = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2),
                                                      attn_mask=part.mask, scale=scale)
            else:
                attn = self._decode_in_parts(plan, queries, lambda ids: read(k_rows, ids),
                                             lambda ids: read(v_rows, ids), scale)
            out[:d] = attn.reshape(d, num_heads, head_dim)
        start = d
        for i, (rows, mask, num_new) in enumerate(plan.prefill):
            end = start + num_new
            if rows is None:
                # [1, heads, rows, head_dim]: 4-D, so the CPU takes its fused (flash) kernel; the
                # math path (3-D) builds the whole rows x rows score matrix: 8x slower at 2,048 rows
                queries = q[start:end].transpose(0, 1)[None]
                keys, values = stored(k_new[start:end]), stored(v_new[start:end])
                keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
                if up:
                    queries, keys, values = queries.float(), keys.float(), values.float()
                if mask is None:  # causal over its own rows
                    attn = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale,
                                                          enable_gqa=group > 1)
                else:  # a chunk longer than a sliding window: under the window's band
                    attn = banded(queries, keys, values, mask, plan.window, scale, group > 1)
                out[start:end] = attn[0].transpose(0, 1)
            else:
                assert mask is not None
                keys, values = read(k_rows, rows), read(v_rows, rows)
                # over a cached prefix, the `group` query heads of one KV head become `group`
                # blocks of query rows of that head: its K/V are read as they are, not repeated;
                # 4-D (a batch of one), so the CPU takes its fused (flash) kernel, not the math
                # path's separate products, softmax and mask scans: 2x faster at 2,048 rows
                queries = q[start:end].view(num_new, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
                queries = queries.reshape(1, num_kv_heads, group * num_new, head_dim)
                keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
                if up:
                    queries, keys, values = queries.float(), keys.float(), values.float()
                attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.grouped_mask(i, group),
                                                      scale=scale)
                out[start:end] = attn.view(num_kv_heads, group, num_new, head_dim).permute(2, 0, 1, 3).reshape(
                    num_new, num_heads, head_dim)
            start = end
        return out

    @staticmethod
    def _decode_in_parts(plan: ReadPlan, queries: torch.Tensor, read_k: Callable[[torch.Tensor], torch.Tensor],
                         read_v: Callable[[torch.Tensor], torch.Tensor], scale: float) -> torch.Tensor:
        """Decode attention ``[d, kv_heads, group, head_dim]``: each part's sequences over their
        own rows in one call, then each group's queries over the group's shared rows in one
        call, the results merged by the CPU flash kernel's log-sum-exps."""
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        d, num_kv_heads, group, head_dim = queries.shape
        attn = queries.new_empty(queries.shape)
        lse = queries.new_empty((d, num_kv_heads, group))
        for part in plan.decode_parts:
            n = d if part.index is None else part.index.numel()
            mine = queries if part.index is None else queries.index_select(0, part.index)
            keys = read_k(part.rows).to(queries.dtype).view(n, part.length, num_kv_heads, head_dim)
            values = read_v(part.rows).to(queries.dtype).view(n, part.length, num_kv_heads, head_dim)
            part_attn, part_lse = flash(mine, keys.transpose(1, 2), values.transpose(1, 2),
                                        attn_mask=part.bias(queries.dtype), scale=scale)
            if part.index is None:
                attn.copy_(part_attn)
                lse.copy_(part_lse)
            else:
                attn.index_copy_(0, part.index, part_attn)
                lse.index_copy_(0, part.index, part_lse)
        for members, rows in plan.decode_groups:
            shared_k, shared_v = read_k(rows).to(queries.dtype), read_v(rows).to(queries.dtype)
            part_attn, part_lse = flash(grouped(queries, members), shared_k.transpose(0, 1)[None],
                                        shared_v.transpose(0, 1)[None], scale=scale)
            merge(attn, lse, members, part_attn, part_lse)
        return attn
