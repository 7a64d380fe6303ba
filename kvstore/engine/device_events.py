"""DeviceEvents: the device tier (medium GPU) as KV events, one block per KV group it holds.

A device block keeps every layer of its tokens (kvstore/engine/groups.py), but a hybrid
model's store and its events name a block per KV group: the group's own key
(``group_keys``, H(GROUP_TAG, key, group)), its group index, kind and window. A device
block so announces one block per group whose layers hold its KV (``Block.valid``: all of
them for a computed block, those fetched for one filled from the store), and its removal
removes those. A model of one group announces its chain keys under that group, as before
groups existed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.events.groups import event_groups
from kvstore.events.publisher import EventPublisher
from kvstore.events.replay_ring import HeldBlock
from kvstore.events.wire import GPU, EventGroup
from kvstore.layout import KVLayout

GroupKeys = Callable[[Sequence[bytes], int], list[bytes]]


class DeviceEvents:
    """Publishes the device prefix cache's changes on ``publisher``."""

    def __init__(self, publisher: EventPublisher, layout: KVLayout, group_keys: GroupKeys) -> None:
        self.publisher = publisher
        self.block_size = layout.block_size
        self.groups: tuple[EventGroup, ...] = event_groups(layout)
        self._group_keys = group_keys

    def stored(self, key: bytes, parent: bytes | None, token_ids: Sequence[int] | None, valid: int) -> None:
        """A device block now holds ``key``'s KV for the groups in the bitmask ``valid``."""
        if len(self.groups) == 1:
            self.publisher.stored(GPU, [key], [parent], self.block_size, token_ids, group=self.groups[0])
            return
        keys, parents, groups = self._per_group([(key, parent, valid)])
        tokens = None if token_ids is None else list(token_ids) * len(keys)
        self.publisher.stored(GPU, keys, parents, self.block_size, tokens, groups=groups)

    def removed(self, blocks: Sequence[tuple[bytes, int]]) -> None:
        """These ``(key, valid)`` blocks left the device cache."""
        if not blocks:
            return
        if len(self.groups) == 1:
            self.publisher.removed(GPU, [key for key, _ in blocks], group=self.groups[0])
            return
        keys, _, groups = self._per_group([(key, None, valid) for key, valid in blocks])
        self.publisher.removed(GPU, keys, groups=groups)

    def held(self, blocks: Sequence[tuple[bytes, bytes | None, int]]) -> list[HeldBlock]:
        """The snapshot of ``(key, parent, valid)`` device blocks, as events name them."""
        if len(self.groups) == 1:
            return [(key, parent, self.groups[0]) for key, parent, _ in blocks]
        keys, parents, groups = self._per_group(blocks)
        return list(zip(keys, parents, groups, strict=True))

    def _per_group(self, blocks: Sequence[tuple[bytes, bytes | None, int]],
                   ) -> tuple[list[bytes], list[bytes | None], list[EventGroup | None]]:
        """Every block's group keys, their parents' and their groups, group by group."""
        keys: list[bytes] = []
        parents: list[bytes | None] = []
        groups: list[EventGroup | None] = []
        for group in self.groups:
            mine = [(key, parent) for key, parent, valid in blocks if valid >> group.idx & 1]
            if not mine:
                continue
            keys += self._group_keys([key for key, _ in mine], group.idx)
            for _, parent in mine:
                parents.append(None if parent is None else self._group_keys([parent], group.idx)[0])
            groups += [group] * len(mine)
        return keys, parents, groups
