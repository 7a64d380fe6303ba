"""EventView: what one publisher holds, per medium, rebuilt from its event batches alone.

A pure state machine (no sockets): ``apply(batch)`` folds a batch in. ``BlockStored`` adds
each hash to its medium (with its parent and its KV group), ``BlockRemoved`` takes it out of
that medium, ``AllBlocksCleared`` empties every medium. Set semantics make replays idempotent:
applying a batch twice, or applying batches a snapshot already reflects, leaves the same view.
Events without a medium (vLLM before it had one) count as ``GPU``. Thread-safe.

KV groups: each block keeps the group its ``BlockStored`` named (``EventGroup``: index, kind,
window; None where the event named none), so a consumer asks per group (``blocks(medium,
group=g)``, ``group_of``, ``groups``) and for a hybrid model's reconciled hit (``hit_on``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import numpy as np

from kvstore.events.groups import reconciled_hits
from kvstore.events.wire import (
    GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventGroup,
)

_Block = tuple[BlockHash | None, EventGroup | None]  # (parent, group)


class EventView:
    """Per-medium block sets of one publisher. The Subscriber feeds it; readers query it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._media: dict[str, dict[BlockHash, _Block]] = {}
        self._groups: dict[int, EventGroup] = {}  # every group a BlockStored named, by index
        self.num_events = 0
        self.num_unknown_removals = 0  # removals of blocks the view did not hold (a sign of loss)

    def apply(self, batch: EventBatch) -> None:
        """Fold ``batch``'s events into the view, in order."""
        with self._lock:
            for event in batch.events:
                self.num_events += 1
                if isinstance(event, BlockStored):
                    blocks = self._media.setdefault(event.medium or GPU, {})
                    parent = event.parent_block_hash
                    group = event.group
                    if group is not None:
                        self._groups[group.idx] = group
                    for h in event.block_hashes:
                        blocks[h] = (parent, group)
                        parent = h
                elif isinstance(event, BlockRemoved):
                    blocks = self._media.setdefault(event.medium or GPU, {})
                    for h in event.block_hashes:
                        if blocks.pop(h, None) is None:
                            self.num_unknown_removals += 1
                elif isinstance(event, AllBlocksCleared):
                    self._media.clear()

    def clear(self) -> None:
        with self._lock:
            self._media.clear()

    def blocks(self, medium: str, group: int | None = None) -> set[BlockHash]:
        """A copy of the hashes ``medium`` holds (of KV group ``group`` only, when given)."""
        with self._lock:
            held = self._media.get(medium, {})
            if group is None:
                return set(held)
            return {h for h, (_, g) in held.items() if g is not None and g.idx == group}

    def held(self) -> dict[str, set[BlockHash]]:
        """A copy of every non-empty medium's hashes."""
        with self._lock:
            return {m: set(b) for m, b in self._media.items() if b}

    def media_of(self, block_hash: BlockHash) -> set[str]:
        """The media holding ``block_hash`` (empty: none)."""
        with self._lock:
            return {m for m, b in self._media.items() if block_hash in b}

    def parent_of(self, medium: str, block_hash: BlockHash) -> BlockHash | None:
        with self._lock:
            block = self._media.get(medium, {}).get(block_hash)
            return None if block is None else block[0]

    def group_of(self, block_hash: BlockHash) -> EventGroup | None:
        """The KV group of ``block_hash`` as its ``BlockStored`` named it (None: held nowhere,
        or named no group)."""
        with self._lock:
            for blocks in self._media.values():
                block = blocks.get(block_hash)
                if block is not None and block[1] is not None:
                    return block[1]
        return None

    def groups(self) -> dict[int, EventGroup]:
        """Every KV group the events named (index -> group), stale ones included."""
        with self._lock:
            return dict(self._groups)

    def prefix_on(self, medium: str, hashes: Iterable[BlockHash]) -> int:
        """How many leading ``hashes`` ``medium`` holds (a router's cached-prefix length)."""
        n = 0
        with self._lock:
            blocks = self._media.get(medium, {})
            for h in hashes:
                if h not in blocks:
                    break
                n += 1
        return n

    def hit_on(self, media: str | Sequence[str], hashes_by_group: Sequence[Sequence[BlockHash]],
               windows: Sequence[int | None]) -> int:
        """A hybrid model's prefix hit, in blocks: the longest boundary at which ``media``
        (one medium, or several pooled) hold what every KV group needs (events/groups.py).

        Args:
            hashes_by_group: per group, its keys of the prompt's blocks (``group_keys``), all
                of one length.
            windows: per group, ``window_blocks`` (None: full attention).
        """
        names = [media] if isinstance(media, str) else list(media)
        num_blocks = len(hashes_by_group[0]) if hashes_by_group else 0
        held = np.zeros((len(hashes_by_group), num_blocks, 1), dtype=bool)
        with self._lock:
            sets = [self._media.get(m, {}) for m in names]
            for g, hashes in enumerate(hashes_by_group):
                if len(hashes) != num_blocks:
                    raise ValueError(f"group {g} has {len(hashes)} hashes, group 0 {num_blocks}")
                for i, h in enumerate(hashes):
                    held[g, i, 0] = any(h in s for s in sets)
        return int(reconciled_hits(held, windows)[0])

    def __len__(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._media.values())
