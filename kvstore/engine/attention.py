"""The engine's attention on the torch path: one gather plan per step, shared by every layer.

With Triton (CUDA, or ``KVSTORE_KERNELS=triton``) the model calls ``kernels/`` directly. On
the torch path the kernels' references rebuild their index tensors, masks and input checks
in each of the model's layers, although a step's block tables are the same for all of them;
at decode sizes that per-call work costs more than the attention. ``StepPlan`` builds them
once per step, and each layer is then an ``index_copy_`` (new K/V into the pool), an
``index_select`` (the sequences' rows out of it) and ``scaled_dot_product_attention``.
``tests/engine/test_model_parity.py`` holds the result to transformers.

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

import torch
import torch.nn.functional as F

from kvstore import kernels
from kvstore.kernels import pack_rows, unpack_rows


def use_torch_path(device: torch.device) -> bool:
    """True where ``kernels`` would run its torch reference (the dispatcher's rule)."""
    backend = kernels.kernel_backend()
    return backend == "reference" or (backend == "auto" and device.type != "cuda")


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
    """

    def __init__(self, slots: torch.Tensor, decode_tables: list[list[int]], decode_lens: list[int],
                 prefill: list[tuple[list[int], int, int]], block_size: int, rows_per_block: int,
                 device: torch.device) -> None:
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
        self.decode_len = max(decode_lens, default=0)
        self.decode_rows: torch.Tensor | None = None
        self.decode_mask: torch.Tensor | None = None
        if decode_lens:
            lens = torch.tensor(decode_lens)
            pos = torch.arange(self.decode_len)
            # Padding positions read the sequence's row 0 (always written, so finite) and are masked.
            pos = torch.where(pos[None, :] < lens[:, None], pos[None, :], 0)
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long)
            slots_2d = tables.gather(1, pos // block_size) * block_size + pos % block_size
            self.decode_rows = self._rows(slots_2d.flatten()).to(device)
            if min(decode_lens) != self.decode_len:
                visible = torch.arange(self.decode_len)[None, :] < lens[:, None]
                self.decode_mask = visible[:, None, None, :].to(device)
        # per prefill chunk: (rows of its whole sequence or None, causal mask or None, num_new)
        self.prefill: list[tuple[torch.Tensor | None, torch.Tensor | None, int]] = []
        for table, seq_len, num_new in prefill:
            context = seq_len - num_new
            if context == 0:  # only new rows: attend to them directly, causally
                self.prefill.append((None, None, num_new))
                continue
            pos = torch.arange(seq_len)
            slots_1d = torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size
            visible = pos[None, :] <= context + torch.arange(num_new)[:, None]
            # additive (0 / -inf) rather than boolean: attention then skips converting it
            bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
            self.prefill.append((self._rows(slots_1d).to(device), bias.to(device), num_new))
        self._grouped: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, group) -> mask repeated

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        return (slots // self.block_size) * self.rows_per_block + slots % self.block_size

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor,
               v_rows: torch.Tensor, scale: float, codes: torch.dtype | None = None) -> torch.Tensor:
        """Write the step's new ``k``/``v`` ``[n, kv_heads, head_dim]`` into one layer's row views
        (quantized pages' rows when ``codes`` names their code dtype) and return the attention
        output ``[n, num_heads, head_dim]`` of ``q``."""
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
            assert self.decode_rows is not None
            keys = read(k_rows, self.decode_rows).view(d, self.decode_len, num_kv_heads, head_dim)
            values = read(v_rows, self.decode_rows).view(d, self.decode_len, num_kv_heads, head_dim)
            # the `group` query heads of one KV head become `group` query rows of that head
            queries = q[:d].reshape(d, num_kv_heads, group, head_dim)
            if up:
                queries, keys, values = queries.float(), keys.float(), values.float()
            attn = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2),
                                                  attn_mask=self.decode_mask, scale=scale)
            out[:d] = attn.reshape(d, num_heads, head_dim)
        start = d
        for i, (rows, mask, num_new) in enumerate(self.prefill):
            end = start + num_new
            if rows is None:
                # [1, heads, rows, head_dim]: 4-D, so the CPU takes its fused (flash) kernel; the
                # math path (3-D) builds the whole rows x rows score matrix: 8x slower at 2,048 rows
                queries = q[start:end].transpose(0, 1)[None]
                keys, values = stored(k_new[start:end]), stored(v_new[start:end])
                keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
                if up:
                    queries, keys, values = queries.float(), keys.float(), values.float()
                attn = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale,
                                                      enable_gqa=group > 1)
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
                attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self._grouped_mask(i, group),
                                                      scale=scale)
                out[start:end] = attn.view(num_kv_heads, group, num_new, head_dim).permute(2, 0, 1, 3).reshape(
                    num_new, num_heads, head_dim)
            start = end
        return out

    def _grouped_mask(self, chunk: int, group: int) -> torch.Tensor:
        """Prefill chunk ``chunk``'s additive mask, repeated for ``group`` query heads per KV head
        (built once per step, used by every layer)."""
        mask = self._grouped.get((chunk, group))
        if mask is None:
            mask = self._grouped[(chunk, group)] = self.prefill[chunk][1].repeat(group, 1)  # type: ignore[union-attr]
        return mask
