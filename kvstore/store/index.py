"""BlockIndex: key -> where the block lives in each level, its pins, and its chain parent."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.results import DISK, HOST, PrefixMatch


@dataclass(slots=True)
class BlockEntry:
    """One block the store knows. It lives in at least one indexed level.

    ``slots[r]`` is the block's slot in the level of rank ``r`` (0 = host, 1 = disk, ...), or
    None where that level does not hold it. Bit ``r`` of ``inexact`` is set when the copy at
    rank ``r`` is not the bytes put: a lossy level's encoding, or a copy decoded from one.
    Only the cascade changes ``slots`` and ``inexact``.
    """

    key: bytes
    parent: bytes | None
    tenant: str
    created: float
    slots: list[int | None]
    pins: int = 0  # pin() calls not yet matched by unpin(); never evicted while > 0
    readers: int = 0  # copies in flight outside the store lock; never evicted while > 0
    num_uses: int = 0  # puts and reads, for "seen twice" admission (a read counts only up to 2)
    last_access: float = 0.0  # time.time() of the last put or read (0.0: not since loaded)
    inexact: int = 0  # bit r: the copy at rank r differs from the bytes put (lossy codec)
    # a writer outside the store lock (a write-through put, a deferred demotion) will publish
    # the block in level ``landing`` (or give up); meanwhile whoever needs it waits
    # (InFlight.wait_written), and lookups report it there
    writing: bool = False
    landing: int = 0
    # cooled (``Cascade.cool``): it serves only hits at boundaries no one used; evicted first,
    # and written down the tiers only under cold_blocks="demote". A read or put warms it again.
    cold: bool = False
    group: int | None = None  # the KV group its put named (kvstore/layout.py); None: not said

    @property
    def best_rank(self) -> int | None:
        """The fastest level holding the block, None when none does."""
        for rank, slot in enumerate(self.slots):
            if slot is not None:
                return rank
        return None

    @property
    def exact_rank(self) -> int | None:
        """The fastest level holding the bytes that were put, None when none does."""
        for rank, slot in enumerate(self.slots):
            if slot is not None and not self.inexact >> rank & 1:
                return rank
        return None

    def is_exact(self, rank: int) -> bool:
        """Whether the copy at ``rank`` (which must exist) is the bytes put."""
        return not self.inexact >> rank & 1

    @property
    def is_held(self) -> bool:
        return any(slot is not None for slot in self.slots)

    @property
    def is_evictable(self) -> bool:
        return self.pins == 0 and self.readers == 0


ROOT_KEYS = 1 << 16  # chains' first blocks remembered with their tenant after they left


class BlockIndex:
    """A dict of BlockEntry with the prefix query; the cascade mutates it under the store lock.

    It also remembers whose chain a key starts after that first block left the store
    (``chain_tenant``: keys are one-way hashes, so a lookup's tenant is known by its root).

    Args:
        level_names: the names of the indexed levels, fastest first (rank order).
    """

    def __init__(self, level_names: tuple[str, ...] = (HOST, DISK)) -> None:
        self.entries: dict[bytes, BlockEntry] = {}
        self.level_names = level_names
        self._roots: OrderedDict[bytes, str] = OrderedDict()  # first blocks of chains that left

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def new_entry(self, key: bytes, parent: bytes | None, tenant: str, created: float) -> BlockEntry:
        """Add an entry held nowhere yet (the caller places it in a level before unlocking)."""
        entry = BlockEntry(key, parent, tenant, created, [None] * len(self.level_names))
        self.add(entry)
        return entry

    def all_new(self, keys: Sequence[bytes]) -> bool:
        """Whether ``keys`` are some, distinct, and none indexed: a chain ``new_entries`` takes."""
        return bool(keys) and self.entries.keys().isdisjoint(keys) and len(set(keys)) == len(keys)

    def new_entries(self, keys: Sequence[bytes], parents: Sequence[bytes | None], tenant: str, created: float,
                    num_uses: int = 0) -> list[BlockEntry]:
        """``new_entry`` for each of ``keys`` (distinct, none indexed), with ``num_uses`` uses
        and ``created`` as their last access: a put's chain in one pass."""
        width = len(self.level_names)
        made = [BlockEntry(key, parent, tenant, created, [None] * width, 0, 0, num_uses, created)
                for key, parent in zip(keys, parents, strict=True)]
        before = len(self.entries)
        self.entries.update(zip(keys, made, strict=True))
        assert len(self.entries) == before + len(made), "a block indexed twice"
        return made

    def get(self, key: bytes) -> BlockEntry | None:
        return self.entries.get(key)

    def add(self, entry: BlockEntry) -> None:
        assert entry.key not in self.entries, f"block {entry.key.hex()} indexed twice"
        assert len(entry.slots) == len(self.level_names), "entry has a slot list of the wrong length"
        self.entries[entry.key] = entry

    def discard(self, key: bytes) -> None:
        self.entries.pop(key, None)

    def remove(self, entry: BlockEntry) -> None:
        """``entry`` leaves the index; a chain's first block leaves its tenant behind it."""
        self.entries.pop(entry.key, None)
        if entry.parent is None:  # whose chain it was outlives it
            self._roots[entry.key] = entry.tenant
            if len(self._roots) > ROOT_KEYS:
                self._roots.popitem(last=False)

    def chain_tenant(self, keys: Sequence[bytes]) -> str | None:
        """Whose chain ``keys`` is, as far as the index can tell: the tenant of its first block,
        held now or remembered; None for a chain never stored."""
        if not keys:
            return None
        entry = self.entries.get(keys[0])
        return entry.tenant if entry is not None else self._roots.get(keys[0])

    def match(self, keys: list[bytes], *, exact: bool = False) -> PrefixMatch:
        """Pure query: per leading key, the best level holding it; stops at the first miss.
        With ``exact``, only copies holding the bytes put count (lossy ones are misses)."""
        entries, names = self.entries, self.level_names
        tiers: list[str] = []
        lossy: list[bool] = []
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                break
            rank = entry.exact_rank if exact else entry.best_rank
            if rank is None:
                if not entry.writing or exact:
                    break
                rank = entry.landing  # a hint: being written there now
                tiers.append(names[rank])
                lossy.append(False)
                continue
            tiers.append(names[rank])
            lossy.append(bool(entry.inexact >> rank & 1))
        return PrefixMatch(num_blocks=len(tiers), tiers=tuple(tiers), lossy=tuple(lossy))
