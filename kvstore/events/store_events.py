"""StoreEvents: a TieredStore's tiers (host, disk, remote) as KV events on a publisher.

The store calls its listeners with its lock held, right after a tier holds a block's bytes
(``blocks_stored``) and right after a block left a tier (``blocks_removed``); this listener
only enqueues on the publisher, which never blocks. Tier names map to media: host -> CPU,
disk -> DISK, remote -> REMOTE. Store tiers do not know token ids: their BlockStored events
carry none.

``attach()`` also announces what the store already holds (a disk catalog reopened at start):
events arriving while that snapshot is read are held back and sent after it, so the stream
ends in the store's true state (set semantics make the overlap harmless).
"""

from __future__ import annotations

import threading
from typing import Any

from kvstore.events.publisher import EventPublisher
from kvstore.events.replay_ring import Held
from kvstore.events.wire import TIER_MEDIA


def medium_of(tier: str) -> str:
    """The medium a store tier is published as (a level kvstore does not know yet: its name, upper-case)."""
    return TIER_MEDIA.get(tier, tier.upper())


class StoreEvents:
    """Publishes one store's tiers. ``attach()`` to start, ``detach()`` to stop."""

    def __init__(self, publisher: EventPublisher, store: Any) -> None:
        self.publisher = publisher
        self.store = store
        self.block_size = store.layout.block_size
        self._lock = threading.Lock()
        self._held_back: list[tuple[Any, ...]] | None = None

    # the listener interface TieredStore calls (under its lock: enqueue only)

    def blocks_stored(self, tier: str, keys: list[bytes], parents: list[bytes | None],
                      groups: list[int | None] | None = None) -> None:
        with self._lock:
            if self._held_back is not None:
                self._held_back.append(("stored", tier, list(keys), list(parents)))
                return
        self.publisher.stored(medium_of(tier), keys, parents, self.block_size)

    def blocks_removed(self, tier: str, keys: list[bytes]) -> None:
        with self._lock:
            if self._held_back is not None:
                self._held_back.append(("removed", tier, list(keys)))
                return
        self.publisher.removed(medium_of(tier), keys)

    # lifecycle

    def attach(self) -> StoreEvents:
        with self._lock:
            self._held_back = []
        self.store.add_listener(self)
        held = self.held()
        with self._lock:
            for medium, block_size, pairs in held:
                if pairs:
                    self.publisher.stored(medium, [k for k, _ in pairs], [p for _, p in pairs], block_size)
            for item in self._held_back:
                if item[0] == "stored":
                    self.publisher.stored(medium_of(item[1]), item[2], item[3], self.block_size)
                else:
                    self.publisher.removed(medium_of(item[1]), item[2])
            self._held_back = None
        self.publisher.add_source(self.held)
        return self

    def detach(self) -> None:
        self.store.remove_listener(self)
        self.publisher.remove_source(self.held)

    def held(self) -> list[Held]:
        """The snapshot source: every tier's (key, parent) pairs, as media."""
        by_tier = self.store.view.held_by_tier()
        return [(medium_of(tier), self.block_size, list(pairs)) for tier, pairs in by_tier.items()]
