"""DiskLevel: local NVMe over tiers.disk.DiskTier (slab file + LMDB catalog, checksummed).

With a codec (``disk_codec``) a slot holds one encoded block padded to 4 KiB, so the slab's
slots are the encoded size and more blocks fit; the checksum covers the encoded bytes. Blocks
move through page-aligned staging rows (read and written in place with O_DIRECT) and are
decoded straight into the caller's rows: a read's transfers are decoded as each arrives and
verifies, on the thread that read it, while the others are in flight. Catalog entries name
the representation in their layout id (``<namespace>`` raw, ``<namespace>/coded`` encoded): a
raw reader never sees encoded bytes, and an encoded block's own header says which codec reads
it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvstore.errors import CodecError
from kvstore.policy.admission import AdmissionPolicy
from kvstore.policy.eviction import EvictionPolicy
from kvstore.results import DISK
from kvstore.store.index import BlockEntry
from kvstore.store.levels.base import BlocksReady, Recovered, SlotLevel
from kvstore.store.levels.coding import LevelCodec
from kvstore.store.levels.staging import Staging, select
from kvstore.store.stats import tier_stats
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.errors import TierError

CODED_SUFFIX = "/coded"  # catalog layout id suffix of encoded blocks


class DiskLevel(SlotLevel):
    """The disk tier as a level. Writes are durable before they are published (the tier
    syncs payloads before its catalog commits); the catalog is the truth after a restart.

    Attributes:
        last_error: the medium's failure behind the last write that returned False or the
            last drop that raised (None before any), for a caller that must report why its
            blocks are not on disk (write-through).
    """

    def __init__(self, tier: DiskTier, rank: int, policy: EvictionPolicy, admission: str | AdmissionPolicy,
                 namespace_id: str, coding: LevelCodec | None = None) -> None:
        super().__init__(DISK, rank, policy, admission, coding)
        self.tier = tier
        self.namespace_id = namespace_id
        self.layout_id = namespace_id if coding is None else f"{namespace_id}{CODED_SUFFIX}"
        # this namespace's layout ids, raw and encoded: a directory holding only these is ours
        self.sibling_ids = (namespace_id, f"{namespace_id}{CODED_SUFFIX}")
        self.last_error: TierError | None = None
        self._staging = Staging(tier.slot_bytes) if coding is not None else None

    def write(self, entries: Sequence[BlockEntry], slots: Sequence[int],
              payloads: torch.Tensor | Sequence[torch.Tensor]) -> bool:
        rows: Sequence[torch.Tensor] = list(payloads) if isinstance(payloads, torch.Tensor) else payloads
        if self.coding is not None:
            assert self._staging is not None
            with self._staging.rows(len(rows)) as staging:
                try:
                    self.coding.encode(rows, staging)
                except CodecError as e:  # checked at put, so not expected: the blocks are not demoted
                    self.tier.release(slots)
                    self.counters.errors += 1
                    self.last_error = TierError(f"the disk codec refused {len(rows)} blocks: {e}")
                    return False
                return self._write(entries, slots, staging)
        return self._write(entries, slots, rows)

    def _write(self, entries: Sequence[BlockEntry], slots: Sequence[int], rows: Sequence[torch.Tensor]) -> bool:
        try:
            self.tier.write([e.key for e in entries], slots, rows, [e.tenant for e in entries],
                            self.layout_id)
        except TierError as e:  # the tier freed the slots
            self.counters.errors += 1
            self.last_error = _detached(e)
            return False
        except ValueError as e:  # a batch the tier refuses (a tenant it cannot record): nothing written
            self.tier.release(slots)
            self.counters.errors += 1
            self.last_error = TierError(f"the disk tier refused {len(entries)} blocks: {e}")
            return False
        return True

    def read(self, keys: Sequence[bytes], slots: Sequence[int], outs: Sequence[torch.Tensor],
             on_ready: BlocksReady | None = None) -> list[bool]:
        if self.coding is None:
            try:
                return self.tier.read(keys, slots, outs, on_ready=on_ready)
            except TierError:
                self.counters.errors += 1
                return [False] * len(keys)
        assert self._staging is not None
        with self._staging.rows(len(keys)) as rows:
            return self._read_coded(keys, slots, outs, rows, on_ready)

    def _read_coded(self, keys: Sequence[bytes], slots: Sequence[int], outs: Sequence[torch.Tensor],
                    rows: list[torch.Tensor], on_ready: BlocksReady | None) -> list[bool]:
        """One read of the encoded slots into ``rows``; each transfer decodes into ``outs`` on
        the thread that read it, once verified, while the others are in flight."""
        coding = self.coding
        assert coding is not None
        flags = [False] * len(keys)
        refused: list[bytes] = []

        def decode(blocks: list[int], verified: list[bool]) -> None:  # on the tier's reader threads
            good = [i for i, ok in zip(blocks, verified, strict=True) if ok]
            decoded = coding.decode(select(rows, good), select(outs, good))
            for i, ok in zip(good, decoded, strict=True):
                flags[i] = ok
                if not ok:
                    refused.append(keys[i])
            if on_ready is not None:
                on_ready(blocks, [flags[i] for i in blocks])

        try:
            self.tier.read(keys, slots, rows, on_ready=decode)
        except TierError:
            self.counters.errors += 1
            return [False] * len(keys)
        if refused:  # checksummed, but in a format this reader does not know: a counted miss
            self.counters.refused += len(refused)
            self.tier.delete(refused)
        return flags

    def drop(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        try:
            self.tier.delete(keys)
        except TierError as e:  # the catalog did not commit: every block stays (the caller's to handle)
            self.last_error = _detached(e)
            raise

    def recover(self) -> list[Recovered]:
        """As Level.recover. Blocks of this namespace's other representation (raw vs encoded)
        never reach a reader: they are deleted, counted as refused.

        Raises:
            TierError: the directory holds blocks of another namespace (another model or
                layout of the same block size): it is not this store's, and nothing is deleted.
        """
        entries = list(self.tier.entries())
        others = {d.layout_id for d in entries if d.layout_id not in self.sibling_ids}
        if others:
            theirs = sum(d.layout_id in others for d in entries)
            raise TierError(
                f"disk tier at {self.tier.path} holds {theirs} blocks of layout {sorted(others)[0]!r}"
                f"{f' (and {len(others) - 1} other layouts)' if len(others) > 1 else ''}, not this store's "
                f"({self.layout_id!r}); use another path or delete the directory"
            )
        foreign = [d.key for d in entries if d.layout_id != self.layout_id]
        if foreign:
            self.counters.refused += len(foreign)
            self.tier.delete(foreign)
        found = sorted((d for d in entries if d.layout_id == self.layout_id), key=lambda d: d.last_access,
                       reverse=True)
        return [Recovered(d.key, d.slot, d.tenant, d.created, d.last_access) for d in found]

    def stats(self) -> dict[str, Any]:
        # ``errors``: the level's own count (every failed write batch passes through ``write``)
        # plus the tier's corrupt reads, which reach the level only as False; not the tier's
        # ``failed_writes``, which would count each failed batch twice
        return tier_stats(self.counters, self.capacity_bytes, self.num_used, self.slot_bytes,
                          int(self.tier.stats()["corrupt_reads"]))

    def check_integrity(self, held: dict[bytes, int]) -> None:
        catalog = {d.key: d.slot for d in self.tier.entries()}
        assert catalog == held, f"disk catalog ({len(catalog)} blocks) and index ({len(held)} on disk) differ"
        self.tier.check_integrity()

    def close(self) -> None:
        self.tier.close()


def _detached(error: TierError) -> TierError:
    """``error``'s kind and message without its traceback, whose frames would keep the I/O
    buffers they used alive (the slab could not free them at close)."""
    return type(error)(str(error))
