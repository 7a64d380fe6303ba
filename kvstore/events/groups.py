"""KV groups in the events: a layout's groups as the wire names them, and the reconciled hit.

A hybrid layout (kvstore/layout.py) stores each KV group's blocks under keys of their own
(``group_keys``), so a consumer that derives the group keys of a prompt learns from the
events which group blocks a replica holds. A prefix hit needs every group at once:

- a full-attention group, every block before the boundary;
- a sliding-window group, only the ``window_blocks`` blocks that end at the boundary (fewer at
  the start of a prompt), the earlier ones being read by no token after it.

``reconciled_hits`` is that rule over arrays: the longest boundary every group can serve.
It is not a leading run: a sliding-window group that lost the blocks before boundary 8 but
holds those before 5 serves 5, and one that holds only its window at 8 serves 8::

    block       0  1  2  3  4  5  6  7
    full        x  x  x  x  x  x  x  x      every block: hit <= 8
    sliding     .  .  x  x  .  .  x  x      window_blocks = 2: boundaries 4 and 8 are covered
    hit = 8 (the sliding group holds blocks 6, 7: the window ending at 8)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.events.wire import FULL_ATTENTION, FULL_GROUP, SLIDING_WINDOW, EventGroup
from kvstore.layout import FULL, SLIDING, KVLayout

_KINDS = {FULL: FULL_ATTENTION, SLIDING: SLIDING_WINDOW}  # kvstore's kind -> vLLM's KVCacheSpecKind


def event_groups(layout: KVLayout) -> tuple[EventGroup, ...]:
    """Each of the layout's KV groups as the events name it, in group order (a layout without
    groups: ``FULL_GROUP`` alone, what its events always said)."""
    if not layout.groups:
        return (FULL_GROUP,)
    return tuple(EventGroup(i, _KINDS[g.kind], g.window) for i, g in enumerate(layout.groups))


def window_blocks(layout: KVLayout) -> tuple[int | None, ...]:
    """Per KV group, the blocks a hit needs ending at its boundary (None: every block)."""
    return tuple(g.window_blocks(layout.block_size) for g in layout.kv_groups)


def reconciled_hits(held: np.ndarray, windows: Sequence[int | None]) -> np.ndarray:
    """The longest boundary each column can serve (see module).

    Args:
        held: ``[groups, blocks, columns]`` bool: whether a column (a replica, a medium) holds
            group g's block i of one prompt.
        windows: per group, ``window_blocks`` (None: full attention, every block).

    Returns:
        ``[columns]`` ints: the largest n in 0..blocks such that every full group holds blocks
        0..n-1 and every sliding group blocks max(0, n - w)..n-1.
    """
    num_groups, num_blocks, num_columns = held.shape
    assert num_groups == len(windows), f"{num_groups} groups of blocks, {len(windows)} windows"
    ok = np.ones((num_blocks + 1, num_columns), dtype=bool)  # ok[n]: boundary n is served
    boundaries = np.arange(1, num_blocks + 1)
    for g, window in enumerate(windows):
        if window is None:  # boundary n needs the leading run to reach n
            ok[1:] &= np.logical_and.accumulate(held[g], axis=0)
        else:  # boundary n needs the run of held blocks ending at n - 1 to be min(w, n) long
            ok[1:] &= _trailing_runs(held[g]) >= np.minimum(window, boundaries)[:, None]
    # the last boundary served (0 always is)
    return num_blocks - np.argmax(ok[::-1], axis=0)


def needed(num_blocks: int, hits: np.ndarray, windows: Sequence[int | None]) -> np.ndarray:
    """``[groups, blocks, columns]`` bool: the group blocks each column's hit of ``hits[c]``
    blocks reads (full groups: all before it; sliding groups: the window ending at it)."""
    position = np.arange(num_blocks)[:, None]
    below = position < hits[None, :]
    out = np.empty((len(windows), num_blocks, hits.size), dtype=bool)
    for g, window in enumerate(windows):
        out[g] = below if window is None else below & (position >= hits[None, :] - window)
    return out


def _trailing_runs(held: np.ndarray) -> np.ndarray:
    """``[blocks, columns]``: how many held blocks end at each block (0 where it is missing)."""
    position = np.arange(held.shape[0])[:, None]
    last_missing = np.maximum.accumulate(np.where(held, -1, position), axis=0)
    return position - last_missing
