"""StoreEvents: a TieredStore's tiers (host, disk, remote) as KV events on a publisher.

The store calls its listeners with its lock held, right after a tier holds a block's bytes
(``blocks_stored``) and right after a block left a tier (``blocks_removed``); this listener
only enqueues on the publisher, which never blocks. Tier names map to media: host -> CPU,
disk -> DISK, remote -> REMOTE. Store tiers do not know token ids: their BlockStored events
carry none.

KV groups: a store's layout names its groups (``layout.kv_groups``); each stored block's group,
as its put named it, goes on the wire with its kind and window (``event_groups``). A layout of
one group publishes that group for every block (a layout without groups: group 0, full
attention, as before groups existed). In a
hybrid layout a block whose group the store does not know (recovered from disk, delivered by
the remote tier) carries no group fields, stored or removed: a consumer tells the groups
apart by their keys (``group_keys``).

``attach()`` also announces what the store already holds (a disk catalog reopened at start):
events arriving while that snapshot is read are held back and sent after it, so the stream
ends in the store's true state (set semantics make the overlap harmless).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvstore.events.groups import event_groups
from kvstore.events.publisher import EventPublisher
from kvstore.events.replay_ring import Held, HeldBlock
from kvstore.events.wire import FULL_GROUP, TIER_MEDIA, EventGroup


def medium_of(tier: str) -> str:
    """The medium a store tier is published as (a level kvstore does not know yet: its name, upper-case)."""
    return TIER_MEDIA.get(tier, tier.upper())


class StoreEvents:
    """Publishes one store's tiers. ``attach()`` to start, ``detach()`` to stop."""

    def __init__(self, publisher: EventPublisher, store: Any) -> None:
        self.publisher = publisher
        self.store = store
        self.block_size = store.layout.block_size
        self.groups = event_groups(store.layout)
        # the group of a block the store does not name: with one group, that group (every block
        # is of it); with several, not known
        self._default: EventGroup | None = self.groups[0] if len(self.groups) == 1 else None
        self._lock = threading.Lock()
        self._held_back: list[tuple[Any, ...]] | None = None

    # the listener interface TieredStore calls (under its lock: enqueue only)

    def blocks_stored(self, tier: str, keys: list[bytes], parents: list[bytes | None],
                      groups: list[int | None] | None = None) -> None:
        named = self._named(groups)
        with self._lock:
            if self._held_back is not None:
                self._held_back.append(("stored", tier, list(keys), list(parents), named))
                return
        self.publisher.stored(medium_of(tier), keys, parents, self.block_size, group=self._default, groups=named)

    def blocks_removed(self, tier: str, keys: list[bytes], groups: list[int | None] | None = None) -> None:
        named = self._named(groups)
        with self._lock:
            if self._held_back is not None:
                self._held_back.append(("removed", tier, list(keys), named))
                return
        self.publisher.removed(medium_of(tier), keys, group=self._default, groups=named)

    def group_of(self, index: int | None) -> EventGroup | None:
        """Group ``index`` of the store's layout as the events name it (None: not known)."""
        if self._default is not None:
            return self._default
        return self.groups[index] if index is not None and 0 <= index < len(self.groups) else None

    def _named(self, groups: Sequence[int | None] | None) -> list[EventGroup | None] | None:
        """Per key, its group as the events name it; None where the call needs no list (one group)."""
        if self._default is not None or groups is None:
            return None
        return [self.group_of(g) for g in groups]

    # lifecycle

    def attach(self) -> StoreEvents:
        with self._lock:
            self._held_back = []
        self.store.add_listener(self)
        held = self.held()
        with self._lock:
            for medium, block_size, blocks in held:
                if blocks:
                    self.publisher.stored(medium, [b[0] for b in blocks], [b[1] for b in blocks], block_size,
                                          groups=[b[2] if len(b) > 2 else FULL_GROUP for b in blocks])
            for item in self._held_back:
                if item[0] == "stored":
                    self.publisher.stored(medium_of(item[1]), item[2], item[3], self.block_size, group=self._default,
                                          groups=item[4])
                else:
                    self.publisher.removed(medium_of(item[1]), item[2], group=self._default, groups=item[3])
            self._held_back = None
        self.publisher.add_source(self.held)
        return self

    def detach(self) -> None:
        self.store.remove_listener(self)
        self.publisher.remove_source(self.held)

    def held(self) -> list[Held]:
        """The snapshot source: every tier's blocks, as media: ``(key, parent)`` for a layout
        without groups, else ``(key, parent, group)``: the layout's one group, or the group the
        block's put named (None where the store does not know it)."""
        by_tier = self.store.view.held_by_tier()
        if self._default == FULL_GROUP:
            return [(medium_of(tier), self.block_size, [(k, p) for k, p, _ in held]) for tier, held in by_tier.items()]
        out: list[Held] = []
        for tier, held in by_tier.items():
            blocks: list[HeldBlock] = [(k, p, self.group_of(g)) for k, p, g in held]
            out.append((medium_of(tier), self.block_size, blocks))
        return out
