"""What one step reads on the torch path, for one attention window: the decoding sequences' row
ids (in parts, in groups over a shared prefix, or as the CPU decode kernel's index tensors) and
each prefill chunk's rows and mask. ``StepPlan`` (kvstore/engine/attention.py) builds one
``ReadPlan`` a step for each window the model's layers have (None: full attention), and every
layer of that window uses it.

A sliding layer of window W lets a query at position p see keys at ``p - W < q <= p``: a decode
row of a sequence of n tokens (its new one included) reads positions ``[max(0, n - W), n)``, and
a prefill chunk reads from its first row's window start on, under a mask that also hides what
lies below each later row's window. Rows outside a window are never read (the CPU decode kernel
is handed only the rows inside).

Rows: slot ``b * block_size + o`` is row ``b * rows_per_block + o`` of a layer's row view
(kvstore/engine/attention.py, ``row_view``), the same row id in every layer.
"""

from __future__ import annotations

import torch

from kvstore.engine.decode_parts import DecodePart, by_length, in_window

# cpu_rows.row_attention's index tensors: own rows and lengths, members and counts, shared rows and lengths
RowIndex = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class ReadPlan:
    """One window's reads of a step (decode rows first, then prefill chunks, in packing order).

    Args:
        decode_tables, decode_lens: each decoding sequence's block table and length (new token included).
        groups: ``shared_prefixes`` of the decoding sequences (computed once a step for every
            window), or None where groups are not merged (CUDA: no log-sum-exp to merge by).
        prefill: per prefill chunk ``(block_table, seq_len, num_new)``.
        block_size, rows_per_block: the pool's geometry.
        row_kernel: decode through ``kvstore.kernels.cpu_rows`` (``row_index``) rather than in parts.
        window: the layers' window; None: full attention.

    Attributes:
        decode_groups: ``(members, shared rows)`` of each group read once for all its members.
        row_index: the CPU decode kernel's index tensors, or None.
        decode_parts: the decode rows' parts (without the kernel).
        prefill: per chunk ``(rows or None, additive mask or None, num_new)``; rows None: the
            chunk has no context and attends to its own new rows (causally, under the mask if any).
    """

    def __init__(self, decode_tables: list[list[int]], decode_lens: list[int],
                 groups: list[tuple[list[int], list[int]]] | None, prefill: list[tuple[list[int], int, int]],
                 block_size: int, rows_per_block: int, device: torch.device, row_kernel: bool = False,
                 window: int | None = None) -> None:
        self.block_size, self.rows_per_block, self.window = block_size, rows_per_block, window
        d = len(decode_lens)
        # each sequence's own positions: [head_start, head_start + head_len) then [tail_start, n)
        firsts = [0 if window is None else max(0, n - window) for n in decode_lens]
        head_start, head_len, tail_start = list(firsts), [0] * d, list(firsts)
        # decoding sequences that share a prefix: (their indices, the shared rows) read once for all
        self.decode_groups: list[tuple[torch.Tensor, torch.Tensor]] = []
        if groups is not None:
            for members, first, shared in in_window(groups, decode_lens, block_size, window):
                end = len(shared) * block_size
                rows = self._rows_of(torch.tensor([shared]), torch.arange(first, end)[None])[0]
                self.decode_groups.append((torch.tensor(members), rows.to(device)))
                for i in members:
                    head_len[i], tail_start[i] = first - firsts[i], end
        own = [h + n - t for h, n, t in zip(head_len, decode_lens, tail_start, strict=True)]
        spans = (head_start, head_len, tail_start, own)
        self.row_index: RowIndex | None = None
        if row_kernel and d:
            self.row_index = self._row_index(decode_tables, spans)
        # Sequences whose own rows differ by more than 2x attend in separate parts (each padded
        # to its longest): a sequence outside any group would otherwise pad every other one to
        # its whole context. Where the merge is not available (CUDA), one part.
        parts = by_length(own) if groups is not None else [list(range(d))]
        self.decode_parts: list[DecodePart] = []
        for part in parts if d and self.row_index is None else []:
            part_own = [own[i] for i in part]
            length = max(part_own)
            # Padding positions read the sequence's last row (its new token's, written this step,
            # so finite) and are masked. (Not row 0: below a sliding window a block may be one
            # the store never filled for that layer.)
            rows = self._own_rows([decode_tables[i] for i in part], *([s[i] for i in part] for s in spans))
            mask = None
            if min(part_own) != length:
                own_t = torch.tensor(part_own)
                mask = (torch.arange(length)[None, :] < own_t[:, None])[:, None, None, :].to(device)
            index = None if len(part) == d else torch.tensor(part).to(device)
            self.decode_parts.append(DecodePart(index, rows.flatten().to(device), length, mask))
        self.prefill = [self._prefill(*chunk, device) for chunk in prefill]
        self._grouped: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, group) -> mask repeated

    def _prefill(self, table: list[int], seq_len: int, num_new: int, device: torch.device
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """A chunk's rows (from its first row's window start to its end) and additive mask:
        new row r, at position ``context + r``, sees ``(context + r - window, context + r]``."""
        context, window = seq_len - num_new, self.window
        if context == 0 and (window is None or num_new <= window):  # its own rows, causally
            return None, None, num_new
        first = 0 if window is None else max(0, context - window + 1)
        pos = torch.arange(first, seq_len)
        at = context + torch.arange(num_new)[:, None]
        visible = pos[None, :] <= at
        if window is not None:
            visible &= pos[None, :] > at - window
        # additive (0 / -inf) rather than boolean: attention then skips converting it
        bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf")).to(device)
        if context == 0:  # longer than the window: its own rows under the window's band
            return None, bias, num_new
        return self._rows_of(torch.tensor([table]), pos[None])[0].to(device), bias, num_new

    def _rows_of(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Row ids of ``positions`` ``[S, L]`` through block tables ``[S, width]`` (long)."""
        bs = self.block_size
        return tables.gather(1, positions // bs) * self.rows_per_block + positions % bs

    def _own_rows(self, tables: list[list[int]], head_start: list[int], head_len: list[int], tail_start: list[int],
                  own: list[int]) -> torch.Tensor:
        """``[len(tables), max(own)]`` row ids: sequence i's ``own[i]`` rows (``head_len[i]`` from
        ``head_start[i]``, the rest from ``tail_start[i]``), padded with its last row."""
        col = torch.arange(max(own))[None, :]
        head_t, start_t = torch.tensor(head_len)[:, None], torch.tensor(head_start)[:, None]
        tail_t, own_t = torch.tensor(tail_start)[:, None], torch.tensor(own)[:, None]
        pos = torch.where(col < head_t, start_t + col, tail_t + col - head_t)
        pos = torch.where(col < own_t, pos, tail_t + own_t - head_t - 1)
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        return self._rows_of(padded, pos)

    def _row_index(self, tables: list[list[int]], spans: tuple[list[int], list[int], list[int], list[int]]
                   ) -> RowIndex:
        """``row_attention``'s index tensors: own rows and lengths, members and counts, shared
        rows and lengths (the groups')."""
        own_rows, own_t = self._own_rows(tables, *spans), torch.tensor(spans[3])
        grouped = {int(i) for members, _ in self.decode_groups for i in members}
        items: list[tuple[list[int], torch.Tensor | None]] = [(m.tolist(), r) for m, r in self.decode_groups]
        items += [([i], None) for i in range(len(tables)) if i not in grouped]
        counts = torch.tensor([len(m) for m, _ in items])
        members = torch.zeros((len(items), int(counts.max())), dtype=torch.long)
        shared_lens = torch.tensor([0 if r is None else r.numel() for _, r in items])
        shared_rows = torch.zeros((len(items), max(1, int(shared_lens.max()))), dtype=torch.long)
        for b, (m, r) in enumerate(items):
            members[b, : len(m)] = torch.tensor(m)
            if r is not None:
                shared_rows[b, : r.numel()] = r
        return own_rows.contiguous(), own_t, members, counts, shared_rows, shared_lens

    def grouped_mask(self, chunk: int, group: int) -> torch.Tensor:
        """Prefill chunk ``chunk``'s additive mask, repeated for ``group`` query heads per KV head
        (built once per step, used by every layer of this window)."""
        mask = self._grouped.get((chunk, group))
        if mask is None:
            mask = self._grouped[(chunk, group)] = self.prefill[chunk][1].repeat(group, 1)  # type: ignore[union-attr]
        return mask
