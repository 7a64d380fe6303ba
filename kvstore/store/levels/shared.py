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

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstore.policy.admission import AdmissionPolicy, AdmitAll
from kvstore.store.index import BlockEntry
from kvstore.store.levels.coding import LevelCodec
from kvstore.store.stats import TierCounters

SOURCES = ("put", "demote")
OWNER_DOMAIN = b"kvstore/remote-owner/v1\x00"
UNKNOWN_TENANT = "#"  # + an owner tag's hex: the tenant of a block whose owner no name met here matches


def owner_tag(tenant: str) -> bytes:
    """The 16 bytes a shared level records as a block's owner: a digest of the tenant's name
    (the name itself, the chains' salt, never reaches the medium). The same in every
    namespace and store, so one sweep finds a tenant's blocks of every model."""
    return hashlib.sha256(OWNER_DOMAIN + tenant.encode()).digest()[:16]


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
        admission: which offered blocks are sent (``remote_admission``, kvstore/policy/admission.py);
            the medium evicts on its own, so a policy comparing with a victim has none.
    """

    def __init__(self, name: str, source: str, coding: LevelCodec | None = None) -> None:
        if source not in SOURCES:
            raise ValueError(f"a shared level's source must be one of {list(SOURCES)}, got {source!r}")
        self.name = name
        self.source = source
        self.counters = TierCounters()
        self.coding = coding
        self.admission: AdmissionPolicy = AdmitAll()

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

    def admit(self, entries: list[BlockEntry]) -> list[BlockEntry]:
        """Those of ``entries`` (about to be offered, chain order) the admission policy sends."""
        if not entries or isinstance(self.admission, AdmitAll):
            return entries
        flags = self.admission.admit([e.key for e in entries], [e.num_uses for e in entries], None, True)
        return [e for e, ok in zip(entries, flags, strict=True) if ok]

    @abstractmethod
    def leading(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the level holds now (0 when it cannot be reached). A
        hint, like every lookup: it may answer from what the medium said a moment ago."""

    @abstractmethod
    def read(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor],
             tenants: list[str | None] | None = None) -> list[bool]:
        """Copy each block into ``outs[i]`` (uint8, at least the payload size).

        Args:
            tenants: a list of ``len(keys)`` to fill with the tenant of each delivered block
                (the one whose put wrote it), as far as the level can tell.

        Returns:
            Per block, True when ``outs[i]`` holds exactly the bytes put under ``keys[i]``.
        """

    @abstractmethod
    def offer(self, keys: Sequence[bytes], payloads: Sequence[torch.Tensor],
              tenants: Sequence[str] | None = None) -> None:
        """Queue blocks for writing (each copied before this returns); never blocks.
        ``tenants``: whose block each is (recorded with it: ``forget_tenant`` finds them)."""

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the level holds it now (asked, not a hint; a failure: False)."""
        return [False] * len(keys)

    def know_tenant(self, tenant: str) -> None:  # noqa: B027  (optional: a level that records no tenants)
        """``tenant`` uses this store: blocks of its that ``read`` delivers are named after it."""

    def forget_tenant(self, tenant: str) -> tuple[int, list[str]]:
        """Delete every block of ``tenant`` from the level, whichever store wrote it: how many,
        and what failed (empty when done whole). The default: the level keeps no tenants."""
        return 0, [f"the {self.name} tier cannot find a tenant's blocks"]

    def forget_hints(self) -> None:  # noqa: B027  (optional: a level that learns nothing)
        """Drop what the level learned lately of the medium (its next answers ask it)."""

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
