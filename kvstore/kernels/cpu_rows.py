"""Decode attention over KV rows read in place, on the CPU: a C++ kernel built on first use.

On the torch path a decode step first copies each sequence's K/V rows out of the pool
(``index_select``), then runs torch's flash kernel over the copies: twice the memory traffic,
and the flash kernel, tiled for long query blocks, reads a decode step's few query rows' keys
at a third of the machine's bandwidth. ``row_attention`` reads the rows where they lie instead
(``csrc/row_attention.cpp``): each sequence attends to the rows its row ids name, and decoding
sequences over one shared prefix (a group) read its rows once for all of them, in the same
call, with one softmax over each query's shared and own rows.

The kernel is built with the others in ``kvstore.kernels.cpu_ext``: ``load()`` builds them (the
engine calls it at start, never inside a request) and returns None where they cannot be built,
and the engine then keeps the torch path.
"""

from __future__ import annotations

import torch

from kvstore.kernels.cpu_ext import capability, load

__all__ = ["capability", "load", "row_attention"]


def row_attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, own_rows: torch.Tensor,
                  own_lens: torch.Tensor, members: torch.Tensor, counts: torch.Tensor, shared_rows: torch.Tensor,
                  shared_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention of ``q`` ``[S, kv_heads, group, head_dim]`` (one new token per sequence,
    ``group`` query heads per KV head; float32, contiguous) over KV rows read in place.

    Sequence s attends to the shared rows of the item it belongs to, then to its own rows. An
    item is a group of sequences whose contexts begin with the same rows (read once for all of
    them), or a sequence alone (no shared rows). Index tensors are int64 and contiguous; rows
    past a length are never read (pad them with anything).

    Args:
        k_rows, v_rows: one layer's row views ``[R, kv_heads, head_dim]`` (float32, heads
            contiguous, the same row stride), as ``kvstore.engine.attention.row_view`` makes them.
        own_rows, own_lens: ``[S, L]`` row ids and ``[S]`` counts (at least 1) of each
            sequence's own rows.
        members, counts: ``[B, M]`` sequence indices and ``[B]`` counts (at least 1) of each
            item's members; every sequence is in exactly one item.
        shared_rows, shared_lens: ``[B, P]`` row ids and ``[B]`` counts (0 for a sequence alone)
            of each item's shared rows.

    Returns:
        ``[S, kv_heads, group, head_dim]``: softmax(q k^T * scale) v over each sequence's rows.

    Raises:
        RuntimeError: the kernel is not built (call ``load()`` first and check it).
        ValueError: a shape, dtype or stride does not fit, a count, row id or member is out of
            range, or a sequence is in no item or in several.
    """
    module = load()
    if module is None:
        raise RuntimeError("the CPU decode kernel is not built: check kvstore.kernels.cpu_rows.load() first")
    try:
        # named for torch's profiler (a pybind call is not an op it records)
        with torch.profiler.record_function("kvstore::row_attention"):
            out: torch.Tensor = module.row_attention(q, k_rows, v_rows, own_rows, own_lens, members, counts,
                                                     shared_rows, shared_lens, float(scale))
    except RuntimeError as exc:  # the kernel's input checks (TORCH_CHECK): the first line names the problem
        raise ValueError(str(exc).split("\n")[0]) from exc
    return out
