"""A hybrid model's KV groups in vLLM's blocks: where a hit may end, and which blocks of each
group a load, a save and a cooling touch. Pure: no vLLM, no I/O but the store's lookups.

vLLM (its hybrid KV cache manager on) keeps one block table per KV cache group, and kvstore
keeps group g's blocks under group g's keys (kvstore/keys.py, ``group_keys``). A hit at
boundary n (blocks 0 .. n-1 cached, the next token at n x block_size) needs, per group::

    full attention       blocks 0 .. n-1
    sliding window W     only its w = cdiv(W - 1, block_size) blocks n-w .. n-1

                 0  ...  first  ...  n-w  ...  n-1 | n
    full         [ vLLM's own ][ loaded from kvstore ]
    sliding      . . . . . . . . . . [ vLLM | loaded ]    (. : vLLM's null block, never read)

vLLM's own prefix-cache hit (``first`` blocks, reconciled by vLLM) covers every group's needs
up to it; the connector loads, per group, the blocks beyond it that the group needs
(``load_blocks``). The hit is the longest boundary every group can serve (``reconcile``): a
group that lacks a block it needs shrinks it, so a hit is never reported that some group
cannot deliver.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.api import BlockStore
from kvstore.layout import FULL, KVGroup

TIER_ORDER = ("host", "disk", "remote")  # fastest first; an unknown tier counts as the slowest


def window_of(group: KVGroup, block_size: int) -> int | None:
    """Blocks a hit needs of ``group``, ending at the boundary; None: every block (full attention)."""
    return group.window_blocks(block_size)


def reconcile(groups: Sequence[KVGroup], block_size: int, n_max: int, present: Callable[[int, int], bool]) -> int:
    """The longest boundary ``n <= n_max`` at which every group has the blocks a hit needs;
    ``present(g, i)`` says whether group g's block i can be had. 0 when none can.

    A sliding group's first missing block j in the window of n rules out every boundary in
    (j, n] (j lies in each of their windows), so the search jumps to j: one pass per gap.
    """
    n = n_max
    for g, group in enumerate(groups):
        if group.kind == FULL:
            run = 0
            while run < n and present(g, run):
                run += 1
            n = run
    while n > 0:
        lowest_missing = n
        for g, group in enumerate(groups):
            w = window_of(group, block_size)
            if w is None:
                continue
            for i in range(max(0, n - w), n):
                if not present(g, i):
                    lowest_missing = min(lowest_missing, i)
                    break
        if lowest_missing == n:
            return n
        n = lowest_missing
    return 0


def load_blocks(group: KVGroup, block_size: int, first: int, n: int) -> range:
    """The blocks of ``group`` a hit at boundary ``n`` loads beyond vLLM's own ``first``."""
    w = window_of(group, block_size)
    return range(first if w is None else max(first, n - w), n)


def live_start(group: KVGroup, block_size: int, num_computed_tokens: int) -> int:
    """The first block of ``group`` vLLM may still hold for a request whose ``num_computed_tokens``
    are computed: 0 for full attention; for a sliding window, the first block not wholly below
    the window of the next token (vLLM frees the ones below and may hand them to another request
    in the same step, so a save must never read them)."""
    if group.window is None:
        return 0
    return max(0, num_computed_tokens - group.window + 1) // block_size


def cold_blocks(group: KVGroup, block_size: int, start: int, n: int, hit: int) -> list[int]:
    """The blocks of ``group`` from ``start`` that lie below the window of boundary ``n`` and
    outside the window of ``hit`` (the boundary the request's own hit was at): they serve only
    hits at other boundaries, so the store evicts them first. None for full attention."""
    w = window_of(group, block_size)
    if w is None:
        return []
    used = range(max(0, hit - w), hit)
    return [i for i in range(start, max(start, n - w)) if i not in used]


def coldest(tiers: Sequence[str]) -> str:
    """The slowest of ``tiers`` (TIER_ORDER); "" for none."""
    if not tiers:
        return ""
    return max(tiers, key=lambda t: TIER_ORDER.index(t) if t in TIER_ORDER else len(TIER_ORDER))


class GroupLookup:
    """Which group blocks of one prompt the store holds, asked lazily: one lookup per full group
    (its whole run), one per sliding group and window tried (usually one).

    Args:
        groups: the layout's KV groups (``KVLayout.kv_groups``).
        block_size: tokens per block.
        store: the store (its ``group_keys`` and ``lookup``).
        keys: the prompt's chain keys, one per full block that may be hit.
    """

    def __init__(self, groups: Sequence[KVGroup], block_size: int, store: BlockStore, keys: Sequence[bytes]) -> None:
        self.groups = tuple(groups)
        self.block_size = block_size
        self.store = store
        self.keys = list(keys)
        self.num_lookups = 0
        self._group_keys: dict[int, list[bytes]] = {}
        self._known: list[dict[int, str | None]] = [{} for _ in self.groups]  # index -> tier, None: missing

    def group_keys(self, g: int) -> list[bytes]:
        if g not in self._group_keys:
            self._group_keys[g] = self.store.group_keys(self.keys, g)
        return self._group_keys[g]

    def present(self, g: int, i: int) -> bool:
        """Whether the store holds group g's block i (asking it if no lookup said yet)."""
        known = self._known[g]
        if i not in known:
            w = window_of(self.groups[g], self.block_size)
            stop = len(self.keys) if w is None else min(len(self.keys), i + w)
            self._ask(g, i, stop)
        return known.get(i) is not None

    def _ask(self, g: int, start: int, stop: int) -> None:
        """Look group g's blocks ``start .. stop - 1`` up: the leading run held, then one missing."""
        self.num_lookups += 1
        found = self.store.lookup(self.group_keys(g)[start:stop])
        known = self._known[g]
        for j, tier in enumerate(found.tiers[: found.num_blocks]):
            known[start + j] = tier
        if start + found.num_blocks < stop:
            known[start + found.num_blocks] = None

    def hit(self, n_max: int, first: int = 0) -> int:
        """The longest boundary ``<= n_max`` every group serves, from the store and from vLLM's
        own ``first`` blocks (which every group has what it needs of)."""
        return reconcile(self.groups, self.block_size, min(n_max, len(self.keys)),
                         lambda g, i: i < first or self.present(g, i))

    def tiers(self, n: int, first: int) -> tuple[str, ...]:
        """Per block ``i < n``: the slowest tier a hit at ``n`` loads block i of any group from
        ("" for vLLM's own blocks, before ``first``)."""
        out: list[str] = []
        for i in range(n):
            found = [self._known[g].get(i) for g, group in enumerate(self.groups)
                     if i in load_blocks(group, self.block_size, first, n)]
            out.append(coldest([t for t in found if t]))
        return tuple(out)
