"""EventView: what one publisher holds, per medium, rebuilt from its event batches alone.

A pure state machine (no sockets): ``apply(batch)`` folds a batch in. ``BlockStored`` adds
each hash to its medium (with its parent), ``BlockRemoved`` takes it out of that medium,
``AllBlocksCleared`` empties every medium. Set semantics make replays idempotent: applying a
batch twice, or applying batches a snapshot already reflects, leaves the same view.
Events without a medium (vLLM before it had one) count as ``GPU``. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvstore.events.wire import GPU, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch


class EventView:
    """Per-medium block sets of one publisher. The Subscriber feeds it; readers query it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._media: dict[str, dict[BlockHash, BlockHash | None]] = {}
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
                    for h in event.block_hashes:
                        blocks[h] = parent
                        parent = h
                elif isinstance(event, BlockRemoved):
                    blocks = self._media.setdefault(event.medium or GPU, {})
                    for h in event.block_hashes:
                        if blocks.pop(h, 0) == 0:
                            self.num_unknown_removals += 1
                elif isinstance(event, AllBlocksCleared):
                    self._media.clear()

    def clear(self) -> None:
        with self._lock:
            self._media.clear()

    def blocks(self, medium: str) -> set[BlockHash]:
        """A copy of the hashes ``medium`` holds."""
        with self._lock:
            return set(self._media.get(medium, ()))

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
            return self._media.get(medium, {}).get(block_hash)

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

    def __len__(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._media.values())
