"""Store listeners: who is told when a level starts or stops holding a block (KV events).

A listener sees the cascade's placements as they happen: ``blocks_stored`` once a level holds
the bytes (after the write, durable where the level is), ``blocks_removed`` once a block has
left a level (evicted, deleted, found corrupt). Calls come with the store lock held, in the
order the cascade made the changes, so a listener must only record or enqueue: never block,
never call back into the store. A listener that raises is removed and the error is logged;
the store carries on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

log = logging.getLogger(__name__)


class StoreListener(Protocol):
    def blocks_stored(self, tier: str, keys: list[bytes], parents: list[bytes | None],
                      groups: list[int | None]) -> None:
        """``tier`` now holds ``keys`` (chain order where they form a chain); ``groups[i]``: the
        KV group key i's put named (kvstore/layout.py), None where the store does not know it
        (a block recovered from disk or delivered by the remote tier)."""

    def blocks_removed(self, tier: str, keys: list[bytes], groups: list[int | None]) -> None:
        """``keys`` have left ``tier``; ``groups[i]``: key i's KV group, as for ``blocks_stored``."""


class Listeners:
    """The store's listeners, and the fan-out the cascade calls."""

    def __init__(self) -> None:
        self._listeners: list[StoreListener] = []

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def add(self, listener: StoreListener) -> None:
        self._listeners.append(listener)

    def remove(self, listener: StoreListener) -> None:
        self._listeners.remove(listener)

    def stored(self, tier: str, keys: Sequence[bytes], parents: Sequence[bytes | None],
               groups: Sequence[int | None] | None = None) -> None:
        if self._listeners and keys:
            known = list(groups) if groups is not None else [None] * len(keys)
            self._each(lambda listener: listener.blocks_stored(tier, list(keys), list(parents), known))

    def removed(self, tier: str, keys: Sequence[bytes], groups: Sequence[int | None] | None = None) -> None:
        if self._listeners and keys:
            known = list(groups) if groups is not None else [None] * len(keys)
            self._each(lambda listener: listener.blocks_removed(tier, list(keys), known))

    def _each(self, call: object) -> None:
        for listener in list(self._listeners):
            try:
                call(listener)  # type: ignore[operator]
            except Exception:
                log.exception("store listener %r failed; it is removed", listener)
                self._listeners.remove(listener)
