"""Placement: where each indexed block lives, changed in one place.

The only writer of ``BlockEntry.slots`` and ``BlockEntry.inexact``, of the levels' eviction
policies' membership, and of the listeners' events: a level holds a block once ``place`` has
pointed its entry at a slot there and the policy tracks it; it stops holding it once
``unplace``, ``drop``, ``discard_copy``, ``lost`` or ``delete`` took that back. ``publish`` =
``place`` + ``announce`` (the listeners hear it). An entry no level holds and nobody reads
leaves the index (``forget_if_unheld``) and is remembered as seen once (admission).

Every method expects the store lock held.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import TierError
from kvstore.policy.admission import SeenOnce
from kvstore.store.index import BlockEntry, BlockIndex
from kvstore.store.inflight import InFlight
from kvstore.store.levels.base import Level
from kvstore.store.listeners import Listeners


class Placement:
    """The placements of one store's blocks over its indexed levels (rank order)."""

    def __init__(self, levels: Sequence[Level], index: BlockIndex, listeners: Listeners, inflight: InFlight,
                 seen_once: SeenOnce) -> None:
        self.levels = levels
        self.index = index
        self.listeners = listeners
        self.inflight = inflight
        self.seen_once = seen_once

    def publish_written(self, rank: int, entries: list[BlockEntry], slots: Sequence[int],
                        exact: Sequence[bool] | None = None) -> None:
        """``publish`` what a write into level ``rank`` just stored, counted as written there."""
        level = self.levels[rank]
        level.counters.bytes_written += len(entries) * level.payload_bytes
        self.publish(rank, entries, slots, exact)

    def publish(self, rank: int, entries: list[BlockEntry], slots: Sequence[int],
                exact: Sequence[bool] | None = None) -> None:
        """Make ``entries`` (their bytes already in ``slots`` of level ``rank``) visible there.
        ``exact[i]``: the bytes written were the bytes put (default: all were); a lossy
        level's copies are never exact."""
        self.place(rank, entries, slots, exact)
        self.announce(rank, entries)

    def place(self, rank: int, entries: list[BlockEntry], slots: Sequence[int],
              exact: Sequence[bool] | None = None) -> None:
        """The first half of ``publish``: ``entries`` point at their ``slots`` of level
        ``rank`` and its policy tracks them. No reader sees them before the store lock is let
        go, so a writer may place before it writes the bytes (while the entries are still in
        the CPU caches), provided it writes, or ``unplace``s, before it lets go; then it
        ``announce``s them."""
        level = self.levels[rank]
        bit = 1 << rank
        lossy = level.lossy  # a property: read once, not per block
        for i, (entry, slot) in enumerate(zip(entries, slots, strict=True)):
            entry.slots[rank] = slot
            if lossy or (exact is not None and not exact[i]):
                entry.inexact |= bit
            else:
                entry.inexact &= ~bit
        level.policy.insert([e.key for e in entries], [e.parent for e in entries])

    def announce(self, rank: int, entries: list[BlockEntry]) -> None:
        """The second half of ``publish``: tell the listeners level ``rank`` holds ``entries``."""
        if self.listeners:
            self.listeners.stored(self.levels[rank].name, [e.key for e in entries], [e.parent for e in entries],
                                  [e.group for e in entries])

    def unplace(self, rank: int, entries: list[BlockEntry]) -> None:
        """Undo ``place`` (the bytes could not be written); the caller frees the slots."""
        level = self.levels[rank]
        for entry in entries:
            entry.slots[rank] = None
            level.policy.remove(entry.key)

    def discard_copy(self, rank: int, entry: BlockEntry) -> None:
        """Level ``rank`` gives up ``entry``'s copy (e.g. a decoded copy making way for the
        bytes put); the entry stays indexed even if no level holds it now.

        A host copy being read (``readers > 0``: a copy outside the lock, a read lease) keeps
        its slot: the slot is retired, neither free nor the entry's, and reused only after
        the entry's last reader is done (``end_read``). So a reader never sees its slot hold
        another block, while new readers already find the copy that replaces it."""
        level = self.levels[rank]
        slot = entry.slots[rank]
        assert slot is not None
        if rank == 0 and entry.readers:
            self.inflight.retire(entry, slot)
        else:
            level.drop([entry.key], [slot])
        level.policy.remove(entry.key)
        entry.slots[rank] = None
        self.listeners.removed(level.name, [entry.key], [entry.group])

    def lost(self, rank: int, entries: list[BlockEntry]) -> None:
        """Level ``rank`` found these blocks corrupt or unreadable and already freed their slots."""
        level = self.levels[rank]
        gone = [e for e in entries if e.slots[rank] is not None]
        for entry in gone:
            entry.slots[rank] = None
            level.policy.remove(entry.key)
        self.listeners.removed(level.name, [e.key for e in gone], [e.group for e in gone])

    def delete(self, entries: list[BlockEntry]) -> None:
        """Remove ``entries`` (none pinned or being read) from every level and the index."""
        for level in self.levels:
            held = [e for e in entries if e.slots[level.rank] is not None]
            if held:
                # dropped first: a medium that fails (TierError) leaves this level as it was
                level.drop([e.key for e in held], [e.slots[level.rank] for e in held])  # type: ignore[misc]
                for entry in held:
                    level.policy.remove(entry.key)
                    entry.slots[level.rank] = None
                self.listeners.removed(level.name, [e.key for e in held], [e.group for e in held])
        for entry in entries:
            self.index.discard(entry.key)

    def drop(self, level: Level, entries: list[BlockEntry]) -> bool:
        """``entries`` (victims, tail first, already out of ``level``'s policy) leave ``level``.
        False when its medium failed to let them go (a catalog that cannot commit): then
        they stay there, fully indexed and back in the policy (their bytes are intact; the
        catalog, the truth after a restart, still names them), the failure is counted, and
        no room was made."""
        rank = level.rank
        try:
            level.drop([e.key for e in entries], [e.slots[rank] for e in entries])  # type: ignore[misc]
        except TierError:
            level.counters.errors += 1
            chain = entries[::-1]
            level.policy.insert([e.key for e in chain], [e.parent for e in chain])
            return False
        for entry in entries:
            entry.slots[rank] = None
        self.listeners.removed(level.name, [e.key for e in entries], [e.group for e in entries])
        for entry in entries:
            self.forget_if_unheld(entry)
        return True


    def forget(self, entry: BlockEntry) -> None:
        """Drop an entry no level holds; remember it for 'seen twice' admission."""
        self.index.remove(entry)
        self.seen_once.add(entry.key)

    def forget_if_unheld(self, entry: BlockEntry) -> None:
        """``forget`` ``entry`` if no level holds it, nobody reads it, and it is still indexed."""
        if entry.readers == 0 and not entry.is_held and self.index.entries.get(entry.key) is entry:
            self.forget(entry)

    def recover(self, level: Level) -> None:
        """Index what a persistent level kept from an earlier run: its catalog is the truth."""
        found = level.recover()
        for item in found:
            entry = self.index.get(item.key)
            if entry is None:
                entry = self.index.new_entry(item.key, None, item.tenant, item.created)
            entry.slots[level.rank] = item.slot
            if level.lossy:
                entry.inexact |= 1 << level.rank
        # newest first: the policy treats the list like a chain and evicts its end first
        level.policy.insert([d.key for d in found], [None] * len(found))
