"""BlockIndex: key -> where the block lives in each level, its pins, and its chain parent."""

from __future__ import annotations

from dataclasses import dataclass, field

HOST = "host"
DISK = "disk"
REMOTE = "remote"


@dataclass(slots=True)
class BlockEntry:
    """One block the store knows. It lives in at least one indexed level.

    ``slots[r]`` is the block's slot in the level of rank ``r`` (0 = host, 1 = disk, ...), or
    None where that level does not hold it. Only the cascade changes ``slots``.
    """

    key: bytes
    parent: bytes | None
    tenant: str
    created: float
    slots: list[int | None]
    pins: int = 0  # pin() calls not yet matched by unpin(); never evicted while > 0
    readers: int = 0  # copies in flight outside the store lock; never evicted while > 0
    num_uses: int = 0  # puts and reads, for "seen twice" admission
    last_access: float = 0.0  # time.time() of the last put or read (0.0: not since loaded)

    @property
    def best_rank(self) -> int | None:
        """The fastest level holding the block, None when none does."""
        for rank, slot in enumerate(self.slots):
            if slot is not None:
                return rank
        return None

    @property
    def is_held(self) -> bool:
        return any(slot is not None for slot in self.slots)

    @property
    def is_evictable(self) -> bool:
        return self.pins == 0 and self.readers == 0


@dataclass(frozen=True)
class PrefixMatch:
    """The answer of a lookup: the leading run of keys some tier holds.

    Attributes:
        num_blocks: length of the leading run of found blocks (a lookup stops at the first miss).
        tiers: for each found block, the fastest tier holding it ("host", "disk", ...).
    """

    num_blocks: int
    tiers: tuple[str, ...] = field(default=())

    def count(self, tier: str) -> int:
        return sum(1 for t in self.tiers if t == tier)


class BlockIndex:
    """A dict of BlockEntry with the prefix query; the cascade mutates it under the store lock.

    Args:
        level_names: the names of the indexed levels, fastest first (rank order).
    """

    def __init__(self, level_names: tuple[str, ...] = (HOST, DISK)) -> None:
        self.entries: dict[bytes, BlockEntry] = {}
        self.level_names = level_names

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def new_entry(self, key: bytes, parent: bytes | None, tenant: str, created: float) -> BlockEntry:
        """Add an entry held nowhere yet (the caller places it in a level before unlocking)."""
        entry = BlockEntry(key, parent, tenant, created, [None] * len(self.level_names))
        self.add(entry)
        return entry

    def get(self, key: bytes) -> BlockEntry | None:
        return self.entries.get(key)

    def add(self, entry: BlockEntry) -> None:
        assert entry.key not in self.entries, f"block {entry.key.hex()} indexed twice"
        assert len(entry.slots) == len(self.level_names), "entry has a slot list of the wrong length"
        self.entries[entry.key] = entry

    def discard(self, key: bytes) -> None:
        self.entries.pop(key, None)

    def match(self, keys: list[bytes]) -> PrefixMatch:
        """Pure query: per leading key, the best level holding it; stops at the first miss."""
        entries, names = self.entries, self.level_names
        tiers: list[str] = []
        for key in keys:
            entry = entries.get(key)
            rank = entry.best_rank if entry is not None else None
            if rank is None:
                break
            tiers.append(names[rank])
        return PrefixMatch(num_blocks=len(tiers), tiers=tuple(tiers))
