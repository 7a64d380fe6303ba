"""A mapping of a namespace's shared host pool: its slots and their generation counters.

The daemon's host tier lives in a memfd (``kvstore.tiers.host.HostTier(shared=True)``): slot ``i`` at
byte ``i * slot_bytes``, then one little-endian uint64 generation per slot. Both the daemon
(to receive socket puts in place) and same-host clients (to copy blocks, and to read the
generations of slots they hold under a lease) map it through this one class, so the layout
is written down once.

Lock-free reads (docs/protocol.md, "Shared memory"): a client that held a key's slot under a
lease, and read its generation ``gen`` then, may later copy the slot without asking again,
and keeps the copy only if the slot's generation still equals ``gen`` after the copy. The
host tier increments a slot's generation when it frees the slot, before anyone can write
into it again, so an unchanged generation means the slot held that key's bytes throughout
the copy. That argument needs
the copy's loads to complete before the generation's re-read, which x86-64 guarantees
(loads are not reordered with other loads); elsewhere ``lock_free`` is False and every read
takes a lease.
"""

from __future__ import annotations

import mmap
import os
import platform
import sys

import numpy as np
import torch

PAGE = 4096
LOCK_FREE_MACHINES = ("x86_64", "amd64")


def shared_file_bytes(slot_bytes: int, num_slots: int) -> int:
    """Size of the shared file: the slots, then the generations rounded up to a page."""
    return slot_bytes * num_slots + -(-8 * num_slots // PAGE) * PAGE


class MappedPool:
    """``slots``: ``[num_slots, slot_bytes]`` uint8 tensor; ``generations``: uint64 per slot
    (None for a file without them)."""

    def __init__(self, path: str, slot_bytes: int, num_slots: int, generations: bool = True) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            size = shared_file_bytes(slot_bytes, num_slots) if generations else slot_bytes * num_slots
            # MAP_POPULATE builds the page tables now: a copy then takes no page faults
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.view = memoryview(self._mmap)
        self.slots = torch.frombuffer(self._mmap, dtype=torch.uint8, count=slot_bytes * num_slots).view(
            num_slots, slot_bytes)
        self.generations: np.ndarray | None = None
        self._generation_list: memoryview | None = None  # the same counters, read one by one
        if generations:
            self.generations = np.frombuffer(self._mmap, dtype="<u8", count=num_slots, offset=slot_bytes * num_slots)
            if sys.byteorder == "little":  # "Q" is native order, the file's is little-endian
                self._generation_list = self.view[slot_bytes * num_slots : slot_bytes * num_slots + 8 * num_slots].cast("Q")

    @staticmethod
    def lock_free() -> bool:
        """Whether this machine's memory model lets a reader trust the generation check."""
        return platform.machine().lower() in LOCK_FREE_MACHINES

    def generations_of(self, slots: list[int]) -> list[int]:
        """The current generation of each slot: stable while the caller holds the slots under
        a lease; otherwise what a lock-free read compares before and after its copy."""
        if self.generations is None or not slots:
            return []
        if self._generation_list is not None:  # a few dozen slots: plain indexing beats numpy's setup
            counters = self._generation_list
            return [counters[slot] for slot in slots]
        return self.generations[np.asarray(slots, dtype=np.intp)].tolist()
