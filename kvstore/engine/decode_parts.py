"""Decode parts: which decoding sequences the torch path attends together, and how a group's
attention over its shared prefix merges into its members' own.

Sequences whose own rows differ by more than 2x attend in separate parts (``by_length``), so
one long sequence does not pad the others to its length. Sequences whose block tables begin
alike form groups (``shared_prefixes``): a group's shared rows are attended once for all of
its queries (``grouped``), and that part merges into each member's attention over its own rows
by the flash kernel's log-sum-exps (``merge``). A sliding-window layer keeps a group only where
the rows its members' windows share still pay (``in_window``). kvstore/engine/read_plan.py builds
these once a step, for each window the model's layers have.
"""

from __future__ import annotations

import torch


class DecodePart:
    """Decoding sequences attended in one call over their own rows: ``index`` (None: every
    decoding sequence), their rows padded to ``length`` a sequence, and the mask of the real
    ones (None: all are)."""

    def __init__(self, index: torch.Tensor | None, rows: torch.Tensor, length: int, mask: torch.Tensor | None) -> None:
        self.index, self.rows, self.length, self.mask = index, rows, length, mask
        self._bias: dict[torch.dtype, torch.Tensor] = {}

    def bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as the flash kernel takes it: additive, in the queries' dtype (built once a step)."""
        if self.mask is None:
            return None
        bias = self._bias.get(dtype)
        if bias is None:
            bias = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._bias[dtype] = bias = bias.masked_fill_(~self.mask, float("-inf"))
        return bias


def by_length(lengths: list[int]) -> list[list[int]]:
    """Indices of ``lengths`` in parts whose longest is at most twice their shortest (ascending
    indices within a part; one part when all are that close)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    parts: list[list[int]] = []
    for i in order:
        if parts and 2 * lengths[i] >= lengths[parts[-1][0]]:
            parts[-1].append(i)
        else:
            parts.append([i])
    return [sorted(p) for p in parts]


GROUP_MIN_ROWS = 256  # a group's shared rows are read once when that saves at least this many row reads


def shared_prefixes(tables: list[list[int]], lens: list[int], block_size: int) -> list[tuple[list[int], list[int]]]:
    """Groups of decoding sequences whose block tables start alike: ``(members, shared blocks)``.

    Sequences are grouped by their first block; a group shares the blocks its members' tables
    all begin with, short of each member's last token (every member keeps a row of its own to
    attend to). Only groups whose shared rows, read once instead of once per member, save at
    least GROUP_MIN_ROWS row reads are returned.
    """
    by_first: dict[int, list[int]] = {}
    for i, table in enumerate(tables):
        if table:
            by_first.setdefault(table[0], []).append(i)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        limit = min((lens[i] - 1) // block_size for i in members)
        first = tables[members[0]]
        shared = 0
        while shared < limit and all(tables[i][shared] == first[shared] for i in members):
            shared += 1
        if shared * block_size * (len(members) - 1) >= GROUP_MIN_ROWS:
            groups.append((members, first[:shared]))
    return groups


def in_window(groups: list[tuple[list[int], list[int]]], lens: list[int], block_size: int,
              window: int | None) -> list[tuple[list[int], int, list[int]]]:
    """The groups of ``shared_prefixes`` that a layer of ``window`` (None: full attention) reads:
    ``(members, first, shared blocks)``, the group's rows being positions ``[first, len(shared)
    * block_size)``.

    A member of length n sees positions ``[n - window, n)``, so the rows every member sees start
    at ``first``, the latest of those starts; each member reads the positions of its window below
    ``first`` as rows of its own::

        positions     0 ......... first ........ end ........ n
        member A          [A's window ....................... nA)
        member B               [B's window ..................... nB)
        group rows                [first ..... end)
        A's own rows      [.....)                [........... nA)

    A group whose rows save fewer than GROUP_MIN_ROWS row reads is dropped: its members attend alone.
    """
    kept = []
    for members, shared in groups:
        end = len(shared) * block_size
        first = 0 if window is None else max(max(0, lens[i] - window) for i in members)
        if (end - first) * (len(members) - 1) >= GROUP_MIN_ROWS:
            kept.append((members, first, shared))
    return kept


def grouped(queries: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """A group's queries ``[d, kv_heads, group, head_dim]`` as the rows of one batch item:
    ``[1, kv_heads, members * group, head_dim]``."""
    _, num_kv_heads, group, head_dim = queries.shape
    n = members.numel()
    return queries.index_select(0, members).transpose(0, 1).reshape(1, num_kv_heads, n * group, head_dim)


def merge(attn: torch.Tensor, lse: torch.Tensor, members: torch.Tensor, part_attn: torch.Tensor,
           part_lse: torch.Tensor) -> None:
    """Merge a group's attention over its shared rows (``grouped``'s layout, with log-sum-exps)
    into its members' attention over their own rows, in place, by the log-sum-exps."""
    _, num_kv_heads, group, head_dim = attn.shape
    n = members.numel()
    part_attn = part_attn[0].reshape(num_kv_heads, n, group, head_dim).transpose(0, 1)
    part_lse = part_lse[0].reshape(num_kv_heads, n, group).transpose(0, 1)
    own, own_lse = attn.index_select(0, members), lse.index_select(0, members)
    total = torch.logaddexp(own_lse, part_lse)
    merged = own * torch.exp(own_lse - total)[..., None] + part_attn * torch.exp(part_lse - total)[..., None]
    attn.index_copy_(0, members, merged)
    lse.index_copy_(0, members, total)
