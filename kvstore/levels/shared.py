"""SharedLevel: a level other stores share (the remote tier), below every indexed level.

An indexed level (``base.Level``) holds slots this store owns, and the block index says what
sits where. A shared level holds blocks that any store of the deployment may have put, and
that the medium may drop on its own (Redis evicts by ``maxmemory``): no local index could be
right about it, and indexing every block ever sent would grow without bound. So a shared
level is asked, not indexed:

- lookups and reads continue into it where the indexed run ends (``leading``, ``read``);
- blocks reach it by ``offer``: write-behind, never blocking, dropping and counting under
  pressure; ``source`` says which blocks are offered: every put ("put"), or only blocks that
  leave the local levels ("demote");
- blocks it delivers are promoted into host RAM like any lower-level hit.

The cascade keeps shared levels in their own list (``Cascade.shared``) and walks it where
the indexed levels end; adding another shared medium is one more entry there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstore.levels.coding import LevelCodec
from kvstore.stats import TierCounters

SOURCES = ("put", "demote")


class SharedLevel(ABC):
    """A shared level. Every method is called WITHOUT the store lock held except ``offer``
    (which only copies and queues), and none raises for a failure of the medium: a failure is
    a counted miss or a counted dropped write.

    Attributes:
        name: the tier's name in lookups, stats and events ("remote").
        source: "put" (every block put is offered) or "demote" (blocks leaving the local levels).
        counters: hits and misses of lookups and reads that reached this level.
        coding: the level's lossy codec (``remote_codec``), or None for raw blocks; payloads
            crossing the interface are raw either way.
    """

    def __init__(self, name: str, source: str, coding: LevelCodec | None = None) -> None:
        if source not in SOURCES:
            raise ValueError(f"a shared level's source must be one of {list(SOURCES)}, got {source!r}")
        self.name = name
        self.source = source
        self.counters = TierCounters()
        self.coding = coding

    @property
    def lossy(self) -> bool:
        """Whether the level's copies differ from the bytes put (a lossy codec's)."""
        return self.coding is not None

    @property
    def takes_puts(self) -> bool:
        return self.source == "put"

    @property
    def takes_demotions(self) -> bool:
        return self.source == "demote"

    @abstractmethod
    def leading(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the level holds now (0 when it cannot be reached). A
        hint, like every lookup: it may answer from what the medium said a moment ago."""

    @abstractmethod
    def read(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Copy each block into ``outs[i]`` (uint8, at least the payload size).

        Returns:
            Per block, True when ``outs[i]`` holds exactly the bytes put under ``keys[i]``.
        """

    @abstractmethod
    def offer(self, keys: Sequence[bytes], payloads: Sequence[torch.Tensor]) -> None:
        """Queue blocks for writing (each copied before this returns); never blocks."""

    @abstractmethod
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block offered so far is written or counted as dropped."""

    @abstractmethod
    def discard(self, keys: Sequence[bytes]) -> None:
        """Remove blocks (best effort)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """capacity_bytes, used_bytes, num_blocks, hits, misses, evictions, bytes_read,
        bytes_written, errors, dropped (occupancy is the medium's own, shared by every store)."""

    @abstractmethod
    def watch(self, stored: Callable[[list[bytes]], None]) -> None:
        """Have ``stored(keys)`` called (on the writing thread, without the store lock) once
        blocks this store offered are in the level."""

    def nodes(self) -> list[dict[str, Any]]:
        """Per node of the medium: address, up, memory and evictions (none by default)."""
        return []

    @abstractmethod
    def close(self) -> None:
        """Send what is queued (bounded wait), then release the medium."""
