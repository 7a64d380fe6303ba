"""The slab file: fixed 4 KiB-aligned slots, preallocated, read and written in coalesced runs.

Slot ``s`` occupies bytes ``[s * slot_bytes, (s + 1) * slot_bytes)`` of the file; its first
``payload_bytes`` are the payload and the rest is zero padding. The slab knows nothing about
keys or checksums: it moves bytes between slots and caller memory.

I/O mode: with O_DIRECT (probed at open) every transfer bypasses the page cache, so each iovec
must start on a 4096-byte address and span whole slots. Caller memory that qualifies is used in
place (zero copy); other blocks go through an aligned bounce buffer. Without O_DIRECT (the
filesystem refuses it, or the caller turned it off) transfers are buffered and the touched range
is dropped from the page cache afterwards (POSIX_FADV_DONTNEED).

Each run of consecutive slots moves with one ``preadv``/``pwritev`` per ``IOV_MAX`` iovecs or
per bounce buffer's worth of blocks, whichever comes first.

A read of several transfers keeps ``READERS`` of them in flight: the caller and helper threads
each take the next transfer, read it (into a bounce buffer of their own where O_DIRECT cannot
land in place: a torch tensor is 64-byte aligned, not 4096), copy it out and hand it to
``on_chunk``, then take the next. The reads, the copies (``ctypes.memmove``) and a checksum
over the bytes all let go of the GIL, so a fast medium is read on every core and a slow one
sees several requests queued:

    caller:  read 0 -> buf A, copy out, on_chunk(0) | read 2 -> buf A, copy out, ... | ...
    helper:  read 1 -> buf B, copy out, on_chunk(1) | read 3 -> buf B, copy out, ... | ...

``on_chunk`` hears of a transfer once its bytes are in the caller's memory, on whichever
thread read it (so it must be safe to call from several threads at once, for distinct blocks).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvstore.tiers.buffers import ALIGN, address_of
from kvstore.tiers.errors import TierFullError, TierIOError

BOUNCE_BYTES = 4 << 20  # per bounce buffer (at least one slot); READERS per slab, made at open
READERS = max(2, min(4, os.cpu_count() or 2))  # transfers of one read in flight: the caller's and helpers'
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
_IoOp = Callable[[int, Sequence[memoryview], int], int]
ChunkDone = Callable[[list[int], list[bool]], None]  # (block indices moved, per-block ok)


def is_space_error(error: OSError) -> bool:
    """True for the errnos that mean the medium is out of space or quota."""
    return error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _transfer(op: _IoOp, fd: int, iovs: list[memoryview], offset: int) -> None:
    """Move all of ``iovs`` at ``offset``, at most IOV_MAX per call, resuming after short transfers."""
    while iovs:
        group = iovs[:IOV_MAX]
        done = op(fd, group, offset)
        offset += done
        if done == sum(map(len, group)):
            iovs = iovs[IOV_MAX:]
            continue
        if done == 0:
            raise OSError(errno.EIO, f"short transfer at offset {offset}: {sum(map(len, iovs))} bytes left")
        rest = list(iovs)  # rare: drop what moved, resume inside the first unfinished iovec
        while done >= len(rest[0]):
            done -= len(rest.pop(0))
        rest[0] = rest[0][done:]
        iovs = rest


def _run_starts(slots: Sequence[int], order: list[int]) -> list[int]:
    """Indices into ``order`` where a new run of consecutive slots begins (plus the end)."""
    cuts = [0]
    for pos in range(1, len(order)):
        if slots[order[pos]] != slots[order[pos - 1]] + 1:
            cuts.append(pos)
    cuts.append(len(order))
    return cuts


class Slab:
    """One preallocated slab file and its two descriptors (buffered and, if usable, O_DIRECT)."""

    def __init__(
        self, path: str, num_slots: int, slot_bytes: int, payload_bytes: int, *, direct_io: bool
    ) -> None:
        self.path = path
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.payload_bytes = payload_bytes
        size = num_slots * slot_bytes
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            old_size = os.fstat(self.fd).st_size
            # Slots whose bytes predate this open: the tier keeps catalog entries only for these.
            self.num_surviving_slots = min(old_size // slot_bytes, num_slots)
            if old_size > size:
                os.ftruncate(self.fd, size)
            self._preallocate(size, old_size)
            self.direct_io = direct_io and self._open_direct()
        except BaseException:
            os.close(self.fd)
            raise
        if not self.direct_io:
            self.dfd = self.fd
        self._zeros = memoryview(bytes(slot_bytes - payload_bytes))
        self._pad_sink = memoryview(bytearray(slot_bytes - payload_bytes))  # padding read and ignored
        self._blocks_per_bounce = max(1, BOUNCE_BYTES // slot_bytes)
        self._bounce_pool = [self._new_bounce() for _ in range(READERS)]  # a parallel read takes them all
        self._pool_lock = threading.Lock()
        self._helpers: ThreadPoolExecutor | None = None  # the other readers of a read; started on demand

    def _preallocate(self, size: int, old_size: int) -> None:
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError as e:
            if old_size < size:
                os.ftruncate(self.fd, old_size)
            if not is_space_error(e):
                raise TierIOError(f"cannot preallocate {size} bytes for {self.path}: {e}") from e
            stat = os.statvfs(self.path)
            free = stat.f_bavail * stat.f_frsize
            raise TierFullError(
                f"cannot preallocate {size} bytes for {self.path}: the filesystem has {free} bytes free "
                f"(slab already held {old_size})"
            ) from e

    def _open_direct(self) -> bool:
        """Open an O_DIRECT descriptor and prove one aligned read and write work through it."""
        try:
            self.dfd = os.open(self.path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        except (OSError, AttributeError):
            return False
        probe = mmap.mmap(-1, ALIGN)
        try:
            with memoryview(probe) as view:
                # Writing back the bytes just read leaves slot 0 as it was, even if killed midway.
                if os.preadv(self.dfd, [view], 0) != ALIGN or os.pwritev(self.dfd, [view], 0) != ALIGN:
                    raise OSError(errno.EIO, "short O_DIRECT probe")
            return True
        except OSError:
            os.close(self.dfd)
            return False
        finally:
            probe.close()

    def _new_bounce(self) -> mmap.mmap:
        # anonymous: page aligned; populated now, so a read does not fault its pages in
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(-1, self._blocks_per_bounce * self.slot_bytes, flags=flags)

    def _acquire_bounce(self) -> mmap.mmap:
        with self._pool_lock:
            return self._bounce_pool.pop() if self._bounce_pool else self._new_bounce()

    def _release_bounce(self, bounce: mmap.mmap) -> None:
        with self._pool_lock:
            self._bounce_pool.append(bounce)

    def _helper_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._helpers is None:
                self._helpers = ThreadPoolExecutor(max_workers=READERS - 1, thread_name_prefix="disk-tier-read")
            return self._helpers

    def read(
        self,
        slots: Sequence[int],
        dests: Sequence[memoryview],
        in_place: Sequence[bool],
        on_chunk: ChunkDone | None = None,
    ) -> list[bool]:
        """Fill ``dests[i][:payload_bytes]`` from slot ``slots[i]``; False where the I/O failed.

        ``in_place[i]`` says ``dests[i]`` may take the whole slot directly (O_DIRECT mode: it is
        4096-aligned and at least ``slot_bytes`` long); others are bounced. ``on_chunk(blocks,
        ok)`` runs once the blocks of a transfer are in ``dests``, on the thread that read them
        (see the module docstring), so the caller can verify them while other transfers are in
        flight; every call has returned when ``read`` returns.
        """
        ok = [True] * len(slots)
        chunks = deque(self._plan(slots))
        if not chunks:
            return ok
        helpers = [self._helper_pool().submit(self._read_chunks, chunks, slots, dests, in_place, ok, on_chunk)
                   for _ in range(min(READERS, len(chunks)) - 1)]
        try:
            self._read_chunks(chunks, slots, dests, in_place, ok, on_chunk)
        finally:
            for helper in helpers:  # one not started yet (the pool busy with another read) is
                if not helper.cancel():  # dropped; never return while one writes the caller's memory
                    helper.exception()
        for helper in helpers:
            if not helper.cancelled():
                helper.result()
        return ok

    def _read_chunks(self, chunks: deque[list[int]], slots: Sequence[int], dests: Sequence[memoryview],
                     in_place: Sequence[bool], ok: list[bool], on_chunk: ChunkDone | None) -> None:
        """One reader's loop: take the next transfer until none is left; read it (through a
        bounce buffer of this reader's own where needed), copy it out, tell ``on_chunk``."""
        if not chunks:
            return
        bounce = self._acquire_bounce()
        view = memoryview(bounce)
        try:
            while True:
                try:
                    chunk = chunks.popleft()
                except IndexError:
                    return
                bounced = self._move_chunk(os.preadv, chunk, slots[chunk[0]], dests, in_place, view, ok)
                for dest, segment in bounced:  # memmove lets go of the GIL: other readers go on
                    ctypes.memmove(address_of(dest), address_of(segment), len(segment))
                if on_chunk is not None:
                    on_chunk(chunk, ok)
        except BaseException:
            chunks.clear()  # the other readers stop after their current transfer
            raise
        finally:
            view.release()
            self._release_bounce(bounce)

    def write(
        self, slots: Sequence[int], sources: Sequence[memoryview], in_place: Sequence[bool], *, sync: bool
    ) -> None:
        """Store ``sources[i][:payload_bytes]`` (zero padded) in slot ``slots[i]``, then fdatasync.

        Raises:
            OSError: the first failure; some slots may hold partial data (no entry names them).
        """
        self._move_writes(slots, sources, in_place)
        if sync:
            os.fdatasync(self.fd)
        if not self.direct_io:  # only clean pages can be dropped, hence after the sync
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _plan(self, slots: Sequence[int]) -> list[list[int]]:
        """The transfers of a call: block indices by slot, each run of consecutive slots cut
        into chunks of a bounce buffer's worth."""
        order = sorted(range(len(slots)), key=slots.__getitem__)
        cuts = _run_starts(slots, order)
        return [chunk for r in range(len(cuts) - 1) for chunk in self._chunks(order[cuts[r] : cuts[r + 1]])]

    def _move_writes(self, slots: Sequence[int], sources: Sequence[memoryview], in_place: Sequence[bool]) -> None:
        """Write every block, one transfer at a time, through one bounce buffer where needed."""
        bounce = self._acquire_bounce()
        view = memoryview(bounce)
        try:
            for chunk in self._plan(slots):
                self._move_chunk(os.pwritev, chunk, slots[chunk[0]], sources, in_place, view, [])
        finally:
            view.release()
            self._release_bounce(bounce)

    def _chunks(self, run: list[int]) -> list[list[int]]:
        """A run cut into chunks of at most a bounce buffer's worth of blocks, of equal sizes
        (a parallel read's last transfer, which nothing hides, is no larger than the others)."""
        num_chunks = -(-len(run) // self._blocks_per_bounce)
        if num_chunks == 0:
            return []
        size = -(-len(run) // num_chunks)
        return [run[start : start + size] for start in range(0, len(run), size)]

    def _move_chunk(
        self,
        op: _IoOp,
        chunk: list[int],
        first_slot: int,
        buffers: Sequence[memoryview],
        in_place: Sequence[bool],
        bounce_view: memoryview,
        ok: list[bool],
    ) -> list[tuple[memoryview, memoryview]]:
        """One ``preadv``/``pwritev`` for blocks ``chunk`` in consecutive slots from ``first_slot``.

        Iovecs per block: O_DIRECT in place ``[dest[:slot]]``; O_DIRECT bounced ``[segment]``
        (copied in before a write); buffered ``[buf[:payload], padding]``.

        Returns:
            For a read, ``(destination, bounce segment)`` of each bounced block: the caller
            copies them out before the bounce buffer is reused.
        """
        pb, sb, is_read = self.payload_bytes, self.slot_bytes, op is os.preadv
        iovs: list[memoryview] = []
        bounced: list[tuple[memoryview, memoryview]] = []  # (its destination, its bounce segment)
        for i in chunk:
            if not self.direct_io:
                iovs.append(buffers[i][:pb])
                if sb > pb:
                    iovs.append(self._pad_sink if is_read else self._zeros)
            elif in_place[i]:
                iovs.append(buffers[i][:sb])
            else:
                segment = bounce_view[len(bounced) * sb : (len(bounced) + 1) * sb]
                if not is_read:
                    segment[:pb] = buffers[i][:pb]
                    segment[pb:] = self._zeros
                bounced.append((buffers[i][:pb], segment[:pb]))
                iovs.append(segment)
        try:
            _transfer(op, self.dfd, iovs, first_slot * sb)
        except OSError:
            if not is_read:
                raise
            self._read_one_by_one(chunk, first_slot, buffers, in_place, bounce_view, ok)
            return []
        if is_read and not self.direct_io:
            os.posix_fadvise(self.fd, first_slot * sb, len(chunk) * sb, os.POSIX_FADV_DONTNEED)
        return bounced if is_read else []

    def _read_one_by_one(
        self,
        chunk: list[int],
        first_slot: int,
        dests: Sequence[memoryview],
        in_place: Sequence[bool],
        bounce_view: memoryview,
        ok: list[bool],
    ) -> None:
        """After a failed coalesced read, isolate the unreadable blocks (the bounce buffer is free)."""
        scratch = bounce_view[: self.slot_bytes]
        for position, i in enumerate(chunk):
            target = dests[i][: self.slot_bytes] if self.direct_io and in_place[i] else scratch
            try:
                _transfer(os.preadv, self.dfd, [target], (first_slot + position) * self.slot_bytes)
            except OSError:
                ok[i] = False
                continue
            if target is scratch:
                dests[i][: self.payload_bytes] = scratch[: self.payload_bytes]

    def close(self) -> None:
        """Close the descriptors, stop the helper readers and free the bounce buffers."""
        with self._pool_lock:
            helpers, self._helpers = self._helpers, None
        if helpers is not None:
            helpers.shutdown()
        if self.dfd != self.fd:
            os.close(self.dfd)
        os.close(self.fd)
        for bounce in self._bounce_pool:
            # a view still held (by the traceback of an exception a read raised, say) keeps
            # the buffer mapped until it is collected
            with contextlib.suppress(BufferError):
                bounce.close()
        self._bounce_pool.clear()
