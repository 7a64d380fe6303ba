"""Host tier: one preallocated pool of fixed-size slots in RAM (pinned when CUDA is available)."""

from __future__ import annotations

import heapq
import math
import mmap
import os
from collections.abc import Sequence

import numpy as np
import torch

from kvstore.tiers.errors import TierFullError

PAGE = 4096


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class HostTier:
    """A pool of ``num_slots`` slots of ``slot_bytes`` each (payload rounded up to 4 KiB).

    Every slot starts on a page boundary, so the disk tier can read into it with O_DIRECT.
    Without CUDA the pool is an anonymous mmap (page-aligned by construction).
    Free slots are handed out lowest first, so a run of blocks tends to get adjacent slots and
    moves as one copy.

    With ``shared=True`` the pool is a memfd mapped ``MAP_SHARED`` (never pinned): other
    processes of the same user can map it through ``shm_path`` (the daemon's same-host fast
    path). Closing the tier, or the process exiting, frees it; nothing is left in /dev/shm.
    After the slots, at byte ``generations_offset``, the file holds one little-endian uint64
    per slot, its generation: ``release`` increments it before the slot can be handed out
    again, so a reader that saw generation g before and after copying a slot knows the slot
    held the same block all along (the daemon's lock-free shared-memory reads).

        memfd:  [ slot 0 | slot 1 | ... | slot n-1 | gen 0 | gen 1 | ... | gen n-1 | pad to 4 KiB ]
    """

    def __init__(
        self, capacity_bytes: int, payload_bytes: int, *, pin_memory: bool | None = None, shared: bool = False
    ) -> None:
        if payload_bytes <= 0:
            raise ValueError(f"payload_bytes must be positive, got {payload_bytes}")
        self.payload_bytes = payload_bytes
        self.slot_bytes = round_up(payload_bytes, PAGE)
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise TierFullError(
                f"host capacity {capacity_bytes} bytes is smaller than one slot ({self.slot_bytes} bytes)"
            )
        self.capacity_bytes = self.num_slots * self.slot_bytes
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.pinned = bool(pin_memory) and not shared
        self._mmap: mmap.mmap | None = None
        self._shm_fd: int | None = None
        self.generations: np.ndarray | None = None
        if shared:
            fd = os.memfd_create("kvstore-host-pool", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, self.shared_bytes)
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                self._mmap = mmap.mmap(fd, self.shared_bytes, flags=flags)
            except OSError:
                os.close(fd)
                raise
            self._shm_fd = fd
            self.pool = torch.frombuffer(self._mmap, dtype=torch.uint8, count=self.capacity_bytes).view(
                self.num_slots, self.slot_bytes)
            self.generations = np.frombuffer(self._mmap, dtype="<u8", count=self.num_slots,
                                             offset=self.generations_offset)
        elif self.pinned:
            self.pool = torch.empty((self.num_slots, self.slot_bytes), dtype=torch.uint8, pin_memory=True)
        else:
            # MAP_POPULATE commits the pages now: the capacity is really ours, and the first
            # put does not pay page faults.
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(-1, self.capacity_bytes, flags=flags)
            self.pool = torch.frombuffer(self._mmap, dtype=torch.uint8).view(self.num_slots, self.slot_bytes)
        self._free: list[int] = list(range(self.num_slots))  # a heap; sorted is a valid heap
        # the payloads, viewed once per (dtype, row shape) that reads and writes use
        self._payloads = PayloadViews(self.pool if self.slot_bytes == payload_bytes else self.pool[:, :payload_bytes])

    @property
    def generations_offset(self) -> int:
        """Byte offset of the per-slot generation counters in the shared file."""
        return self.capacity_bytes

    @property
    def shared_bytes(self) -> int:
        """Size of the shared file: the slots, then the generations (page-rounded)."""
        return self.capacity_bytes + round_up(8 * self.num_slots, PAGE)

    @property
    def shm_path(self) -> str | None:
        """Where another process of this user can open the shared pool (None unless shared)."""
        if self._shm_fd is None:
            return None
        return f"/proc/{os.getpid()}/fd/{self._shm_fd}"

    def close(self) -> None:
        """Give the pool's memory back now: drop the tier's views of it (the mapping, or the
        pinned buffer, goes with the last view) and close the shared pool's file descriptor.
        A store's objects refer to each other, so waiting for them to be garbage collected
        would hold the whole capacity until the cyclic collector happens to run. Idempotent."""
        self.pool = torch.empty((0, self.slot_bytes), dtype=torch.uint8)
        self._payloads = PayloadViews(self.pool)
        self.generations = None
        self._mmap = None
        if self._shm_fd is not None:
            os.close(self._shm_fd)
            self._shm_fd = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free slots, lowest first. Raises TierFullError when fewer are free."""
        if n > len(self._free):
            raise TierFullError(f"need {n} host slots, {len(self._free)} free of {self.num_slots}")
        free, pop = self._free, heapq.heappop
        return [pop(free) for _ in range(n)]

    def release(self, slots: Sequence[int]) -> None:
        """Return slots to the free pool. The caller guarantees nobody reads them any more
        (except lock-free readers of the shared pool, which the generation bump tells)."""
        if self.generations is not None and len(slots):
            np.add.at(self.generations, np.asarray(slots, dtype=np.intp), 1)
        for slot in slots:
            heapq.heappush(self._free, slot)

    def slot_view(self, slot: int) -> torch.Tensor:
        """The whole slot (``slot_bytes``, page-aligned) as a uint8 tensor sharing the pool."""
        return self.pool[slot]

    def write(self, slots: Sequence[int], src: torch.Tensor) -> None:
        """Copy ``src``'s rows (one payload each: ``[n, payload_bytes]`` uint8, or any dtype
        and row shape of that many bytes; any device) into the slots, one copy per run."""
        self._payloads.write(slots, src)

    def read(self, slots: Sequence[int], dst: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy the slots' payloads into ``dst``'s rows (as ``write`` takes them), one copy
        per run: a typed ``dst`` needs no byte view of its own."""
        self._payloads.read(slots, dst, non_blocking)

    def check_integrity(self, used_slots: Sequence[int]) -> None:
        """Assert that ``used_slots`` (the owner's view) and the free heap partition the pool."""
        free = set(self._free)
        assert len(free) == len(self._free), "host free list holds a slot twice"
        used = set(used_slots)
        assert len(used) == len(used_slots), "a host slot is used by two blocks"
        assert not (free & used), f"host slots both free and used: {sorted(free & used)[:8]}"
        assert len(free) + len(used) == self.num_slots, (
            f"host slots leak: {len(free)} free + {len(used)} used != {self.num_slots}"
        )


class PayloadViews:
    """A pool's payloads (``[num_slots, payload_bytes]`` uint8, padding left out) viewed as
    rows of a caller's dtype and row shape, each view made once: a copy in or out is then a
    few tensor calls beside the memcpy (each cold one costs microseconds), with no byte view
    of the caller's rows."""

    def __init__(self, payloads: torch.Tensor) -> None:
        self.payloads = payloads
        self._views: dict[tuple[torch.dtype, torch.Size], torch.Tensor] = {}

    def like(self, rows: torch.Tensor) -> torch.Tensor:
        """The payloads as ``[num_slots, *rows.shape[1:]]`` of ``rows.dtype``.

        Raises:
            ValueError: a row of ``rows`` is not one payload's bytes.
        """
        key = (rows.dtype, rows.shape[1:])
        view = self._views.get(key)
        if view is None:
            payload_bytes = self.payloads.shape[1]
            if rows.dim() < 2 or math.prod(rows.shape[1:]) * rows.element_size() != payload_bytes:
                raise ValueError(f"rows of {tuple(rows.shape[1:])} {rows.dtype} are not one payload "
                                 f"({payload_bytes} bytes) each")
            if len(self._views) >= 16:
                self._views.clear()
            view = self._views[key] = self.payloads.view(rows.dtype).view(self.payloads.shape[0], *rows.shape[1:])
        return view

    def pieces(self, slots: Sequence[int], rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(payloads of a run of slots, the rows that go with them)`` per run of consecutive
        ``slots``, as views: ``rows[i]`` pairs with slot ``slots[i]``."""
        pool = self.like(rows)
        return [(pool.narrow(0, first, stop - start), rows if (start, stop) == (0, len(rows)) else rows[start:stop])
                for start, stop, first in slot_runs(slots)]

    def write(self, slots: Sequence[int], src: torch.Tensor) -> None:
        """``payload[slots[i]] = src[i]``, one copy per run of slots."""
        for piece, part in self.pieces(slots, src):
            piece.copy_(part)

    def read(self, slots: Sequence[int], dst: torch.Tensor, non_blocking: bool = False) -> None:
        """``dst[i] = payload[slots[i]]``, one copy per run of slots."""
        for piece, part in self.pieces(slots, dst):
            part.copy_(piece, non_blocking)


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split ``slots`` into runs of consecutive ids: (start index, stop index, first slot).

    slots  = [7, 8, 9, 3, 4, 12]
    runs   = (0, 3, 7), (3, 5, 3), (5, 6, 12)
    """
    if slots and slots[-1] - slots[0] == len(slots) - 1 and slots == list(range(slots[0], slots[-1] + 1)):
        return [(0, len(slots), slots[0])]  # the common case, checked in C: one run
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, i, slots[start]))
            start = i
    return runs
