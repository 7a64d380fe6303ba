"""Sinks besides EventView: callbacks per event, and a fan-out to several sinks.

A Subscriber hands every batch, in sequence order, to its sink's ``apply``. A router that
keeps its own index (block key -> replica -> tiers) gives each replica's Subscriber a
``CallbackSink`` bound to that replica::

    sink = CallbackSink(stored=lambda keys, medium: router.stored("r1", keys, medium),
                        removed=lambda keys, medium: router.removed("r1", keys, medium),
                        cleared=lambda: router.cleared("r1"))
    Subscriber(endpoint, FanOut(EventView(), sink), replay_endpoint=replay).start()

A snapshot arrives as ``cleared()`` followed by ``stored`` calls, so the callbacks need no
special case for it. Events without a medium (old vLLM) are reported as ``GPU``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.events.wire import GPU, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch


class CallbackSink:
    """Calls ``stored(hashes, medium)``, ``removed(hashes, medium)`` and ``cleared()`` for each
    event of each batch, in order (on the Subscriber's thread)."""

    def __init__(self, stored: Callable[[list[BlockHash], str], object],
                 removed: Callable[[list[BlockHash], str], object], cleared: Callable[[], object]) -> None:
        self.stored, self.removed, self.cleared = stored, removed, cleared

    def apply(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.stored(event.block_hashes, event.medium or GPU)
            elif isinstance(event, BlockRemoved):
                self.removed(event.block_hashes, event.medium or GPU)
            elif isinstance(event, AllBlocksCleared):
                self.cleared()


class FanOut:
    """Applies each batch to several sinks, in the order given."""

    def __init__(self, *sinks: object) -> None:
        self.sinks = sinks

    def apply(self, batch: EventBatch) -> None:
        for sink in self.sinks:
            sink.apply(batch)  # type: ignore[attr-defined]
