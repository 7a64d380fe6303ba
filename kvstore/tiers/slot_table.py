"""Per-slot state of a disk tier: FREE / RESERVED / USED, the checksum of each used slot, and
the free extents. The tier's ``_lock`` guards every call; this class does no locking itself.

Slot lifecycle::

    FREE --reserve--> RESERVED --commit (after the catalog txn)--> USED
      ^                  |                                           |
      +---- free (release, failed write) ----+---- free (after the txn that drops it) ----+

Invariants (``check``): FREE slots are exactly the free extents; USED slots are exactly the
catalog's slots, each with the catalog's checksum; the three counts add up to ``num_slots``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from kvstore.tiers.errors import TierFullError
from kvstore.tiers.extents import FreeExtents

FREE, RESERVED, USED = 0, 1, 2
CHECKSUM_BYTES = 16
_STATE_NAMES = ("free", "reserved", "used")


class SlotTable:
    """One byte of state and 16 bytes of checksum per slot (17 bytes of RAM per slot)."""

    def __init__(self, num_slots: int) -> None:
        """A table being loaded: ``adopt`` each cataloged slot, then ``seal`` once."""
        self.num_slots = num_slots
        self._states = bytearray(num_slots)
        self._checksums = bytearray(num_slots * CHECKSUM_BYTES)
        self._sums_view = memoryview(self._checksums)  # slicing a view copies only the 16 bytes
        self.num_used = 0
        self._free = FreeExtents()

    def adopt(self, slot: int, digest: bytes) -> bool:
        """Loading only: mark ``slot`` USED with ``digest``; False if it was adopted already."""
        if self._states[slot] == USED:
            return False
        self._states[slot] = USED
        self._checksums[slot * CHECKSUM_BYTES : (slot + 1) * CHECKSUM_BYTES] = digest
        self.num_used += 1
        return True

    def seal(self) -> None:
        """Loading only: every slot not adopted becomes free, as maximal extents."""
        for run in re.finditer(b"\x00+", self._states):  # FREE == 0: each match is a free extent
            self._free.add(run.start(), run.end() - run.start())

    @property
    def num_free(self) -> int:
        return self._free.num_free

    @property
    def num_reserved(self) -> int:
        return self.num_slots - self._free.num_free - self.num_used

    def reserve(self, count: int) -> list[int]:
        """FREE -> RESERVED for ``count`` slots, contiguous when one free extent holds them."""
        if count > self._free.num_free:
            raise TierFullError(f"need {count} disk slots, {self._free.num_free} free of {self.num_slots}")
        slots = self._free.take(count)
        for slot in slots:
            self._states[slot] = RESERVED
        return slots

    def require(self, slots: Sequence[int], state: int, action: str) -> None:
        """Raise ValueError unless every slot is in range, listed once, and in ``state``."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"cannot {action}: a slot is listed twice in {list(slots)[:16]}")
        for slot in slots:
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"cannot {action} slot {slot}: out of range [0, {self.num_slots})")
            if self._states[slot] != state:
                raise ValueError(
                    f"cannot {action} slot {slot}: it is {_STATE_NAMES[self._states[slot]]}, not {_STATE_NAMES[state]}"
                )

    def commit(self, slots: Sequence[int], digests: Sequence[bytes]) -> None:
        """RESERVED -> USED, recording each slot's checksum (after the catalog commit)."""
        for slot, digest in zip(slots, digests, strict=True):
            self._states[slot] = USED
            self._checksums[slot * CHECKSUM_BYTES : (slot + 1) * CHECKSUM_BYTES] = digest
        self.num_used += len(slots)

    def free(self, slots: Sequence[int]) -> None:
        """RESERVED or USED -> FREE (the caller has checked the states)."""
        for slot in slots:
            if self._states[slot] == USED:
                self.num_used -= 1
            self._states[slot] = FREE
        self._free.add_slots(slots)

    def is_used(self, slot: int) -> bool:
        return self._states[slot] == USED

    def expected(self, slots: Sequence[int]) -> list[bytes | None]:
        """The checksum of each USED slot, None for others; ValueError for one out of range."""
        if slots and not (min(slots) >= 0 and max(slots) < self.num_slots):
            bad = next(s for s in slots if not 0 <= s < self.num_slots)
            raise ValueError(f"cannot read slot {bad}: out of range [0, {self.num_slots})")
        states, sums = self._states, self._sums_view
        return [
            sums[s * CHECKSUM_BYTES : s * CHECKSUM_BYTES + CHECKSUM_BYTES].tobytes()
            if states[s] == USED
            else None
            for s in slots
        ]

    def check(self, cataloged: Iterable[tuple[bytes, int, bytes]]) -> None:
        """Raise AssertionError naming the first mismatch with the catalog's (key, slot, checksum)."""
        owners: dict[int, bytes] = {}
        for key, slot, digest in cataloged:
            if not 0 <= slot < self.num_slots:
                raise AssertionError(
                    f"catalog maps {key.hex()} to slot {slot}, out of range [0, {self.num_slots})"
                )
            if slot in owners:
                raise AssertionError(f"catalog maps both {owners[slot].hex()} and {key.hex()} to slot {slot}")
            owners[slot] = key
            if self._states[slot] != USED:
                raise AssertionError(
                    f"catalog maps {key.hex()} to slot {slot}, which is {_STATE_NAMES[self._states[slot]]}"
                )
            if self._checksums[slot * CHECKSUM_BYTES : (slot + 1) * CHECKSUM_BYTES] != digest:
                raise AssertionError(
                    f"slot {slot} checksum in memory differs from the catalog's for {key.hex()}"
                )
        if len(owners) != self.num_used:
            raise AssertionError(f"catalog has {len(owners)} entries but {self.num_used} slots are used")
        self._free.check()
        for start, length in self._free.extents():
            if self._states[start : start + length] != bytes(length):
                raise AssertionError(f"free extent [{start}, {start + length}) holds a slot that is not free")
        num_free, num_used = self._states.count(FREE), self._states.count(USED)
        if num_free != self._free.num_free:
            raise AssertionError(f"{num_free} slots are free but the free extents hold {self._free.num_free}")
        if num_used != self.num_used:
            raise AssertionError(f"{num_used} slots are used but num_used is {self.num_used}")
        if num_free + num_used + self._states.count(RESERVED) != self.num_slots:
            raise AssertionError(f"free + used + reserved slots != {self.num_slots}")
