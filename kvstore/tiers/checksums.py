"""Block checksums for the disk tier: xxh3_128 (seed 0) over ``key || payload``.

The key is under the checksum so that a block read from the wrong slot (a stale catalog entry,
a slot reused by another key) fails verification like a torn or flipped one. Hashing runs at
~10 GB/s and releases the GIL, so for large batches it runs on a helper thread beside the I/O:
a write hashes while the slab writes; a read verifies each transfer on the thread that read it,
while the others are in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import xxhash

ChunkDone = Callable[[list[int], list[bool]], None]


def checksum(key: bytes, payload: memoryview | bytes) -> bytes:
    """xxh3_128 (seed 0) over ``key || payload``, as its 16-byte big-endian digest."""
    hasher = xxhash.xxh3_128(key)
    hasher.update(payload)
    return hasher.digest()


def _checksums(keys: Sequence[bytes], views: Sequence[memoryview], payload_bytes: int) -> list[bytes]:
    return [checksum(key, view[:payload_bytes]) for key, view in zip(keys, views, strict=True)]


class Checksummer:
    """Checksums of a write computed inline for small batches, beside the I/O on one helper
    thread for large; a read's, on its reader threads."""

    def __init__(self, overlap_bytes: int) -> None:
        self.overlap_bytes = overlap_bytes
        self._helper: ThreadPoolExecutor | None = None  # started by the first large batch
        self._helper_lock = threading.Lock()

    def _pool(self) -> ThreadPoolExecutor:
        with self._helper_lock:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disk-tier-hash")
            return self._helper

    def around_write(
        self,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        payload_bytes: int,
        write: Callable[[], None],
    ) -> list[bytes]:
        """Digest every payload while ``write()`` runs; ``write``'s exception propagates.

        Either way this returns only after hashing stopped reading the caller's memory.
        """
        if len(keys) * payload_bytes < self.overlap_bytes:
            digests = _checksums(keys, views, payload_bytes)
            write()
            return digests
        hashing = self._pool().submit(_checksums, keys, views, payload_bytes)
        try:
            write()
        finally:
            digests = hashing.result()
        return digests

    def verify_read(
        self,
        keys: Sequence[bytes],
        dests: Sequence[memoryview],
        expected: Sequence[bytes],
        payload_bytes: int,
        read: Callable[[ChunkDone], list[bool]],
        on_verified: ChunkDone | None = None,
    ) -> list[bool]:
        """Run ``read(on_chunk)`` and check ``dests[i][:payload_bytes]`` against ``expected[i]``
        as each transfer arrives, on the thread that read it (beside the other transfers).
        ``on_verified(blocks, results)``, if given, then runs on that thread too, once the
        transfer's blocks are checked (``results[i]`` for each ``i`` in ``blocks``).

        Returns:
            Per block: the I/O succeeded and the digest matched.
        """
        results = [False] * len(keys)

        def verify(blocks: list[int], io_ok: list[bool]) -> None:  # on the reader threads, at once
            for i in blocks:
                results[i] = io_ok[i] and checksum(keys[i], dests[i][:payload_bytes]) == expected[i]
            if on_verified is not None:
                on_verified(blocks, results)

        read(verify)
        return results

    def close(self) -> None:
        """Stop the helper thread, if it was started."""
        with self._helper_lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown()
