"""check_integrity: the store's index agrees with every level it indexes.

Tests call it after a storm of concurrent calls; the daemon's idle tick calls it every
minute. It waits for the writes outside the lock to settle first (a block between the halves
of a write-through put is in no level yet, by design).
"""

from __future__ import annotations

from kvstore.store.cascade import Cascade


def check_integrity(cascade: Cascade) -> None:
    """Assert (store lock held) that slots, policies, reader and pin counts, reserved and
    retired host slots and each medium's own accounting agree with the index."""
    cascade.inflight.wait_all_written()
    entries = list(cascade.index.entries.values())
    reserved = cascade.reservations.num_reserved
    assert reserved >= 0
    for entry in entries:
        assert entry.is_held, f"block {entry.key.hex()} indexed but in no tier"
        assert entry.pins >= 0 and entry.readers >= 0, f"block {entry.key.hex()} negative counts"
    retired = cascade.inflight.retired_slots()  # host slots of replaced copies still being read
    for level in cascade.levels:
        rank = level.rank
        held = {e.key: e.slots[rank] for e in entries if e.slots[rank] is not None}
        for entry in entries:
            assert (entry.slots[rank] is not None) == (entry.key in level.policy), (
                f"block {entry.key.hex()}: {level.name} slot and {level.name} policy disagree"
            )
        assert len(level.policy) == len(held)
        level.policy.check_integrity()
        if rank == 0 and reserved == 0:  # reserved host slots are in neither list
            # retired slots count as used: free or another block's, a reader would see it
            cascade.host.check_integrity(held, retired)  # type: ignore[arg-type]
        elif rank > 0:
            level.check_integrity(held)  # type: ignore[arg-type]
