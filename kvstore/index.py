"""BlockIndex: key -> where the block lives in each tier, its pins, and its chain parent."""

from __future__ import annotations

from dataclasses import dataclass, field

HOST = "host"
DISK = "disk"


@dataclass(slots=True)
class BlockEntry:
    """One block the store knows. It lives in at least one tier (host slot or disk slot)."""

    key: bytes
    parent: bytes | None
    tenant: str
    created: float
    host_slot: int | None = None
    disk_slot: int | None = None
    pins: int = 0  # pin() calls not yet matched by unpin(); never evicted while > 0
    readers: int = 0  # copies in flight outside the store lock; never evicted while > 0
    num_uses: int = 0  # puts and reads, for "seen twice" disk admission
    last_access: float = 0.0  # time.time() of the last put or read (0.0: not since loaded)

    @property
    def best_tier(self) -> str | None:
        if self.host_slot is not None:
            return HOST
        if self.disk_slot is not None:
            return DISK
        return None

    @property
    def is_evictable(self) -> bool:
        return self.pins == 0 and self.readers == 0


@dataclass(frozen=True)
class PrefixMatch:
    """The answer of a lookup: the leading run of keys some tier holds.

    Attributes:
        num_blocks: length of the leading run of found blocks (a lookup stops at the first miss).
        tiers: for each found block, the fastest tier holding it ("host" or "disk").
    """

    num_blocks: int
    tiers: tuple[str, ...] = field(default=())

    def count(self, tier: str) -> int:
        return sum(1 for t in self.tiers if t == tier)


class BlockIndex:
    """A dict of BlockEntry with the prefix query; the store mutates it under its lock."""

    def __init__(self) -> None:
        self.entries: dict[bytes, BlockEntry] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def get(self, key: bytes) -> BlockEntry | None:
        return self.entries.get(key)

    def add(self, entry: BlockEntry) -> None:
        assert entry.key not in self.entries, f"block {entry.key.hex()} indexed twice"
        self.entries[entry.key] = entry

    def discard(self, key: bytes) -> None:
        self.entries.pop(key, None)

    def match(self, keys: list[bytes]) -> PrefixMatch:
        """Pure query: per leading key, the best tier holding it; stops at the first miss."""
        entries = self.entries
        tiers: list[str] = []
        for key in keys:
            entry = entries.get(key)
            tier = entry.best_tier if entry is not None else None
            if tier is None:
                break
            tiers.append(tier)
        return PrefixMatch(num_blocks=len(tiers), tiers=tuple(tiers))
