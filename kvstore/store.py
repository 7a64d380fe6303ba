"""TieredStore: the embedded API. The only object that knows more than one tier.

It owns the block index, one eviction policy per tier, the demotion cascade (host -> disk ->
dropped), promotion on reads, the write and admission policies, and the transfer threads.
Every index mutation happens under one lock; bulk copies of blocks that are being read run
outside it, protected by the entry's ``readers`` count (a block being read is never evicted).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvstore import leases
from kvstore.config import StoreConfig
from kvstore.errors import CapacityError, KVStoreError, TierError
from kvstore.eviction import EvictionPolicy, make_policy
from kvstore.index import DISK, HOST, BlockEntry, BlockIndex, PrefixMatch
from kvstore.keys import BlockHasher, ExtraKey, Namespace
from kvstore.stats import TierCounters, tier_stats
from kvstore.transfer import FetchHandle, FetchResult
from tiers.disk import DiskTier
from tiers.host import HostTier

GHOST_KEYS = 1 << 16  # keys remembered as "seen once" for disk_admission="seen_twice"


class TieredStore:
    """A KV block store over host RAM and (optionally) local disk. Thread-safe.

    Invariants kept here: a read never returns bytes other than those put under its key;
    each tier's capacity is a hard limit; a pinned block or one being read is never evicted.
    """

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.layout = config.layout
        self.namespace = Namespace(config.model_id, config.layout, config.hash_algo)
        self.hasher = BlockHasher(self.namespace)
        self._payload = self.layout.bytes_per_block
        self._lock = threading.RLock()
        self._index = BlockIndex()
        self._host = HostTier(config.host_bytes, self._payload, pin_memory=config.pin_host_memory,
                              shared=config.shared_host)
        self._host_policy = make_policy(config.host_policy)
        self._counters = {HOST: TierCounters(), DISK: TierCounters()}
        self._reserved_host = 0  # host slots allocated for promotions not yet published
        self._seen_once: OrderedDict[bytes, None] = OrderedDict()
        self._disk: DiskTier | None = None
        self._disk_policy = make_policy(config.disk_policy)
        if config.disk_path is not None:
            self._disk = DiskTier(
                config.disk_path, config.disk_bytes, self._payload,
                sync=config.sync_disk, direct_io=config.direct_io,
            )
            self._load_catalog()
        self._executor = ThreadPoolExecutor(config.transfer_threads, thread_name_prefix="kvstore-transfer")
        self._closed = False

    # ----------------------------------------------------------------------------- keys

    def block_keys(
        self,
        token_ids: Sequence[int] | np.ndarray,
        tenant: str = "",
        extra_keys: Sequence[Sequence[ExtraKey] | None] | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """One chained key per full block of ``token_ids`` (see kvstore.keys.BlockHasher)."""
        return self.hasher.block_keys(token_ids, tenant, extra_keys, parent)

    # ----------------------------------------------------------------------------- writes

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor, *, tenant: str = "") -> None:
        """Store ``blocks[i]`` under ``keys[i]``; keys are one chain, in prefix order.

        Blocks land in host RAM (and on disk before returning under write-through). A key the
        store already holds is only refreshed: equal keys mean equal bytes.

        Raises:
            LayoutMismatchError: wrong shape, dtype or count.
            CapacityError: host RAM has no evictable slot left (everything pinned or in flight).
        """
        keys = self._check_keys(keys)
        self.layout.check_blocks(blocks, len(keys))
        src = _as_bytes(blocks.detach().to("cpu").contiguous(), len(keys), self._payload)
        # A put bigger than host RAM goes in chunks, tails first: the head chunk is stored last,
        # so it ends up the most recent and a prefix's tail is what gets demoted.
        chunk = max(1, self._host.num_slots // 2)
        for start in reversed(range(0, len(keys), chunk)):
            with self._lock:
                self._check_open()
                self._put_locked(keys, start, min(len(keys), start + chunk), src, tenant)

    def _put_locked(self, keys: list[bytes], start: int, stop: int, src: torch.Tensor, tenant: str) -> None:
        now = time.time()
        fresh: list[int] = []  # indices whose bytes must be copied into new host slots
        refreshed: list[bytes] = []
        index = self._index
        entries: list[BlockEntry] = []  # the fresh ones
        for i in range(start, stop):
            entry = index.get(keys[i])
            if entry is None:
                entry = BlockEntry(keys[i], keys[i - 1] if i > 0 else None, tenant, now)
                index.add(entry)
                fresh.append(i)
                entries.append(entry)
            elif entry.host_slot is None:
                fresh.append(i)
                entries.append(entry)
            else:
                refreshed.append(keys[i])
            self._note_use(entry, now)
        busy = entries + [self._index.entries[k] for k in refreshed]
        for entry in busy:  # in flight: making room must not evict what is being put
            entry.readers += 1
        try:
            if fresh:
                self._store_fresh(entries, fresh, src, refreshed)
            elif refreshed:
                self._host_policy.access(refreshed)
        finally:
            for entry in busy:
                entry.readers -= 1

    def _store_fresh(
        self, entries: list[BlockEntry], fresh: list[int], src: torch.Tensor, refreshed: list[bytes]
    ) -> None:
        if self._host.num_free < len(fresh):
            self._evict_host(len(fresh) - self._host.num_free)
        # Heads get host slots first; tails that find no evictable host slot (all pinned or
        # being read) go straight to disk, and fail the put only where there is no disk room.
        n_host = min(len(fresh), self._host.num_free)
        slots = self._host.allocate(n_host)
        rows = fresh[:n_host]
        if rows and rows[-1] - rows[0] == n_host - 1:  # consecutive rows: no gather copy
            self._host.write(slots, src[rows[0] : rows[-1] + 1])
        elif rows:
            self._host.write(slots, src.index_select(0, torch.tensor(rows, dtype=torch.long)))
        self._publish_on_host(entries[:n_host], slots, refreshed)
        overflow = [(e, i) for e, i in zip(entries[n_host:], fresh[n_host:], strict=True) if e.disk_slot is None]
        if overflow:
            self._write_disk([e for e, _ in overflow], [src[i] for _, i in overflow])
            lost = [e for e, _ in overflow if e.best_tier is None]
            for entry in lost:
                self._index.discard(entry.key)
            if lost:
                raise CapacityError(
                    f"need {len(fresh)} host slots, {n_host} free of {self._host.num_slots} "
                    f"(the rest pinned or being read); {len(lost)} blocks found no disk room either"
                )

    def _publish_on_host(self, placed: list[BlockEntry], slots: list[int], refreshed: list[bytes]) -> None:
        """Make ``placed`` (chain order; their bytes already in ``slots``) visible in host RAM,
        then touch ``refreshed``, the keys of the same chain host already held. Under
        write-through the new blocks reach disk before this returns. Used by put and by the
        daemon's two-phase put (leases.commit_host)."""
        for entry, slot in zip(placed, slots, strict=True):
            entry.host_slot = slot
        self._counters[HOST].bytes_written += len(placed) * self._payload
        self._host_policy.insert([e.key for e in placed], [e.parent for e in placed])
        # Touched after the insert: a found head must stay more recent than the new tail
        # behind it, or LRU would cut the prefix at its head.
        if refreshed:
            self._host_policy.access(refreshed)
        if self.config.write_policy == "write_through":
            on_host = [e for e in placed if e.disk_slot is None]
            self._write_disk(on_host, [self._host.slot_view(e.host_slot) for e in on_host])  # type: ignore[arg-type]

    def _note_use(self, entry: BlockEntry, now: float | None = None) -> None:
        entry.last_access = time.time() if now is None else now
        entry.num_uses += 1
        if entry.num_uses == 1 and entry.key in self._seen_once:
            entry.num_uses = 2  # put again after it was dropped: the second sighting

    def _evict_host(self, n: int) -> None:
        victims = self._pop_victims(self._host_policy, n)
        if not victims:
            return
        # victims come tail first; reversed, they are in chain order as _write_disk expects
        demoted = [v for v in reversed(victims) if v.disk_slot is None and self._admits(v)]
        self._write_disk(demoted, [self._host.slot_view(v.host_slot) for v in demoted])  # type: ignore[arg-type]
        self._host.release([v.host_slot for v in victims if v.host_slot is not None])
        self._counters[HOST].evictions += len(victims)
        for victim in victims:
            victim.host_slot = None
            if victim.best_tier is None:
                self._forget(victim)

    def _pop_victims(self, policy: EvictionPolicy, n: int) -> list[BlockEntry]:
        """Up to ``n`` entries the policy gives up, skipping pinned and in-flight blocks."""
        entries = self._index.entries
        victims: list[BlockEntry] = []
        while len(victims) < n:
            key = policy.pop_victim(lambda k: entries[k].is_evictable)  # type: ignore[index]
            if key is None:
                break
            victims.append(entries[key])  # type: ignore[index]
        return victims

    def _admits(self, entry: BlockEntry) -> bool:
        return self.config.disk_admission == "all" or entry.num_uses >= 2

    def _forget(self, entry: BlockEntry) -> None:
        """Drop an entry that no tier holds any more; remember it for 'seen twice' admission."""
        self._index.discard(entry.key)
        self._seen_once[entry.key] = None
        if len(self._seen_once) > GHOST_KEYS:
            self._seen_once.popitem(last=False)

    def _write_disk(self, entries: list[BlockEntry], payloads: list[torch.Tensor]) -> None:
        """Write ``entries`` (chain order: heads before tails) to disk in one batch: one sync,
        one catalog commit. ``payloads`` are their bytes (host slot views or put rows).

        Blocks that find no disk room (everything pinned) or hit an I/O error get no disk
        slot; the error is counted, and nothing half-written is ever published.
        """
        disk = self._disk
        if disk is None or not entries:
            return
        short = len(entries) - disk.num_free
        if short > 0:
            self._evict_disk(short)
        entries, payloads = entries[: disk.num_free], payloads[: disk.num_free]
        if not entries:
            return
        slots = disk.allocate(len(entries))
        try:
            disk.write([e.key for e in entries], slots, payloads, [e.tenant for e in entries],
                       self.namespace.id)
        except TierError:
            self._counters[DISK].errors += 1
            return
        self._counters[DISK].bytes_written += len(entries) * self._payload
        for entry, slot in zip(entries, slots, strict=True):
            entry.disk_slot = slot
        self._disk_policy.insert([e.key for e in entries], [e.parent for e in entries])

    def _evict_disk(self, n: int) -> None:
        assert self._disk is not None
        victims = self._pop_victims(self._disk_policy, n)
        if not victims:
            return
        self._disk.delete([v.key for v in victims])
        self._counters[DISK].evictions += len(victims)
        for victim in victims:
            victim.disk_slot = None
            if victim.best_tier is None:
                self._forget(victim)

    # ----------------------------------------------------------------------------- reads

    def lookup(self, keys: Sequence[bytes]) -> PrefixMatch:
        """Pure query: the leading run of ``keys`` that some tier holds, and where.

        Changes no recency and no placement. With ``promotion="lookup"`` it also starts an
        asynchronous copy of the matched disk-only blocks up to host (a prefetch hint).
        """
        keys = self._check_keys(keys)
        with self._lock:
            self._check_open()
            match = self._index.match(keys)
            self._count_lookup(match, len(keys))
        if self.config.promotion == "lookup" and DISK in match.tiers:
            disk_keys = [k for k, t in zip(keys, match.tiers, strict=False) if t == DISK]
            self._executor.submit(self._prefetch, disk_keys)
        return match

    def _count_lookup(self, match: PrefixMatch, num_keys: int) -> None:
        host, disk = self._counters[HOST], self._counters[DISK]
        num_host = match.count(HOST)
        host.hits += num_host
        host.misses += match.num_blocks - num_host + (1 if match.num_blocks < num_keys else 0)
        if self._disk is not None:
            disk.hits += match.num_blocks - num_host
            disk.misses += 1 if match.num_blocks < num_keys else 0

    def get(self, keys: Sequence[bytes], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks under ``keys`` as a CPU tensor ``[len(keys), *block_shape]``.

        Args:
            keys: one chain, in prefix order.
            out: optional contiguous CPU tensor of that shape and the layout's dtype to fill.

        Raises:
            KeyError: naming the first key no tier holds (a corrupt block counts as missing).
        """
        keys = self._check_keys(keys)
        out = self.layout.output_blocks(len(keys), out)
        result = self._read_into(keys, _as_bytes(out, len(keys), self._payload), count=True)
        if result.num_blocks < len(keys):
            raise KeyError(f"block {keys[result.num_blocks].hex()} (#{result.num_blocks}) is not in the store")
        return out

    def fetch(self, keys: Sequence[bytes], into: torch.Tensor) -> FetchHandle:
        """Copy the blocks under ``keys`` into ``into`` asynchronously.

        Args:
            keys: one chain, in prefix order.
            into: a contiguous tensor ``[len(keys), *block_shape]`` of the layout's dtype,
                on any device; it must stay alive until the handle is done.

        Returns:
            A handle whose result() is a FetchResult: the leading run of blocks delivered.
        """
        keys = self._check_keys(keys)
        self.layout.check_blocks(into, len(keys))
        if not into.is_contiguous():
            raise ValueError("fetch(into=...) needs a contiguous tensor")
        self._check_open()
        if into.device.type == "cpu":
            dst = _as_bytes(into, len(keys), self._payload)
            return FetchHandle(self._executor.submit(self._read_into, keys, dst), len(keys))

        def to_device() -> FetchResult:
            staging = torch.empty((len(keys), self._payload), dtype=torch.uint8,
                                  pin_memory=self._host.pinned)
            result = self._read_into(keys, staging)
            n = result.num_blocks
            _as_bytes(into, len(keys), self._payload)[:n].copy_(staging[:n], non_blocking=True)
            torch.cuda.current_stream(into.device).synchronize()
            return result

        return FetchHandle(self._executor.submit(to_device), len(keys))

    def _prefetch(self, keys: list[bytes]) -> None:
        """Promote disk-only blocks to host without copying them anywhere else."""
        self._read_into(keys, None)

    def _read_into(self, keys: list[bytes], dst: torch.Tensor | None, count: bool = False) -> FetchResult:
        """Copy the leading run of found blocks into ``dst`` rows ([n, payload] uint8, CPU).

        Three phases: under the lock, resolve each key and mark it as being read (and reserve
        host slots for promotions); without the lock, copy; under the lock again, publish the
        promoted copies and release the readers.
        """
        promote = self.config.promotion != "never"
        with self._lock:
            self._check_open()
            plan: list[tuple[BlockEntry, str]] = []
            entries, now = self._index.entries, time.time()
            for key in keys:  # hot loop: one dict lookup and a few attribute updates a block
                entry = entries.get(key)
                if entry is None:
                    break
                if entry.host_slot is not None:
                    tier = HOST
                elif entry.disk_slot is not None:
                    tier = DISK
                else:
                    break
                entry.readers += 1
                self._note_use(entry, now)
                plan.append((entry, tier))
            if count:
                self._count_lookup(PrefixMatch(len(plan), tuple(t for _, t in plan)), len(keys))
            host_keys = [e.key for e, t in plan if t == HOST]
            if host_keys:
                self._host_policy.access(host_keys)
            from_disk = [e for e, t in plan if t == DISK]
            promo_slots: list[int] = []
            if from_disk and promote:
                self._evict_host(max(0, len(from_disk) - self._host.num_free))
                promo_slots = self._host.allocate(min(len(from_disk), self._host.num_free))
                self._reserved_host += len(promo_slots)
        ok: dict[bytes, bool] = {}
        try:
            ok = self._copy_out(plan, from_disk, promo_slots, dst)
        finally:
            with self._lock:
                self._finish_read(plan, from_disk, promo_slots, ok)
        delivered = 0
        for entry, _tier in plan:
            if not ok.get(entry.key, True):
                break
            delivered += 1
        return FetchResult(delivered, tuple(t for _, t in plan[:delivered]))

    def _copy_out(
        self, plan: list[tuple[BlockEntry, str]], from_disk: list[BlockEntry],
        promo_slots: list[int], dst: torch.Tensor | None,
    ) -> dict[bytes, bool]:
        ok: dict[bytes, bool] = {}
        rows = {e.key: i for i, (e, _t) in enumerate(plan)}
        host_items = [(rows[e.key], e.host_slot) for e, t in plan if t == HOST]
        if dst is not None and host_items:
            idx, slots = zip(*host_items, strict=True)
            if list(idx) == list(range(idx[0], idx[0] + len(idx))):
                self._host.read(slots, dst[idx[0] : idx[0] + len(idx)])
            else:
                for i, slot in host_items:
                    self._host.read([slot], dst[i : i + 1])  # type: ignore[list-item]
            self._counters[HOST].bytes_read += len(host_items) * self._payload
        if from_disk:
            assert self._disk is not None
            n_promo = len(promo_slots)
            outs = [self._host.slot_view(s) for s in promo_slots]
            if dst is not None:
                outs += [dst[rows[e.key]] for e in from_disk[n_promo:]]
            disk_entries = from_disk[: len(outs)]
            try:
                flags = self._disk.read([e.key for e in disk_entries],
                                        [e.disk_slot for e in disk_entries], outs)  # type: ignore[misc]
            except TierError:
                self._counters[DISK].errors += 1
                flags = [False] * len(disk_entries)
            for entry, good in zip(disk_entries, flags, strict=True):
                ok[entry.key] = good
            self._counters[DISK].bytes_read += sum(flags) * self._payload
            if dst is not None:
                for entry, slot in zip(from_disk[:n_promo], promo_slots, strict=True):
                    if ok[entry.key]:
                        self._host.read([slot], dst[rows[entry.key]].unsqueeze(0))
        return ok

    def _finish_read(
        self, plan: list[tuple[BlockEntry, str]], from_disk: list[BlockEntry],
        promo_slots: list[int], ok: dict[bytes, bool],
    ) -> None:
        self._reserved_host -= len(promo_slots)
        promoted: list[BlockEntry] = []
        for i, entry in enumerate(from_disk):
            good = ok.get(entry.key, False)
            if not good and entry.key in ok and entry.disk_slot is not None:
                # the disk tier dropped the corrupt or unreadable slot from its catalog
                entry.disk_slot = None
                self._disk_policy.remove(entry.key)
            elif good:
                self._disk_policy.access([entry.key])
            if i < len(promo_slots):
                if good and entry.host_slot is None and entry.key in self._index:
                    entry.host_slot = promo_slots[i]
                    promoted.append(entry)
                else:
                    self._host.release([promo_slots[i]])
        if promoted:
            self._host_policy.insert([e.key for e in promoted], [e.parent for e in promoted])
        for entry, _tier in plan:
            entry.readers -= 1
            if entry.host_slot is None and entry.disk_slot is None and entry.readers == 0 \
                    and entry.key in self._index.entries:
                self._forget(entry)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Pure query, per key (not only the leading run): does some tier hold it?"""
        keys = self._check_keys(keys)
        with self._lock:
            entries = self._index.entries
            return [k in entries for k in keys]

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove blocks from every tier; returns how many were held. Absent keys are skipped.

        Raises:
            CapacityError: a block is pinned or being read (nothing is deleted then).
        """
        keys = self._check_keys(keys)
        with self._lock:
            self._check_open()
            entries = [e for e in (self._index.get(k) for k in dict.fromkeys(keys)) if e is not None]
            busy = [e for e in entries if not e.is_evictable]
            if busy:
                raise CapacityError(f"{len(busy)} of {len(entries)} blocks are pinned or being read, "
                                    f"first {busy[0].key.hex()}")
            on_disk = [e.key for e in entries if e.disk_slot is not None]
            if on_disk and self._disk is not None:
                self._disk.delete(on_disk)
            self._host.release([e.host_slot for e in entries if e.host_slot is not None])
            for entry in entries:
                self._host_policy.remove(entry.key)
                self._disk_policy.remove(entry.key)
                self._index.discard(entry.key)
            return len(entries)

    # ----------------------------------------------------------------------------- pins

    def pin(self, keys: Sequence[bytes]) -> None:
        """Protect blocks from eviction in every tier until unpinned. KeyError if absent."""
        keys = self._check_keys(keys)
        with self._lock:
            entries = [self._require(k) for k in keys]
            for entry in entries:
                entry.pins += 1

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Undo one pin() of each key. ValueError for a key that is not pinned."""
        keys = self._check_keys(keys)
        with self._lock:
            entries = [self._require(k) for k in keys]
            for entry in entries:
                if entry.pins == 0:
                    raise ValueError(f"block {entry.key.hex()} is not pinned")
            for entry in entries:
                entry.pins -= 1

    def _require(self, key: bytes) -> BlockEntry:
        entry = self._index.get(key)
        if entry is None:
            raise KeyError(f"block {key.hex()} is not in the store")
        return entry

    # ----------------------------------------------------------------------------- leases
    # Zero-copy host-slot access for the daemon's shared-memory clients: see kvstore/leases.py.

    @property
    def shared_pool(self) -> tuple[str, int, int] | None:
        """``(path, slot_bytes, num_slots)`` of the shared host pool, or None if not shared."""
        return leases.shared_pool(self)

    def acquire_host(self, keys: Sequence[bytes]) -> list[int]:
        """Hold the leading run of ``keys`` in host RAM; their slot ids (see leases.acquire_host)."""
        return leases.acquire_host(self, keys)

    def release_host(self, keys: Sequence[bytes]) -> None:
        """End a read lease: undo one ``acquire_host`` of each of ``keys``."""
        leases.release_host(self, keys)

    def reserve_host(self, n: int) -> list[int]:
        """Take ``n`` free host slots for a writer outside the store (see leases.reserve_host)."""
        return leases.reserve_host(self, n)

    def cancel_host(self, slots: Sequence[int]) -> None:
        """Give reserved slots back unpublished."""
        leases.cancel_host(self, slots)

    def commit_host(self, keys: Sequence[bytes], slots: Sequence[int], *, tenant: str = "") -> None:
        """Publish ``keys[i]`` as the bytes written into reserved ``slots[i]`` (like put)."""
        leases.commit_host(self, keys, slots, tenant=tenant)

    # ----------------------------------------------------------------------------- inspection

    def held_keys(self, tenant: str | None = None) -> list[bytes]:
        """Snapshot of the keys the store holds (only ``tenant``'s when given)."""
        with self._lock:
            if tenant is None:
                return list(self._index.entries)
            return [k for k, e in self._index.entries.items() if e.tenant == tenant]

    def block_info(self, key: bytes) -> dict[str, Any] | None:
        """One block's tiers, size, tenant, created/last access times and pins; None if absent."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            tiers = [t for t, slot in ((HOST, entry.host_slot), (DISK, entry.disk_slot)) if slot is not None]
            return {
                "key": key.hex(), "tier": entry.best_tier, "tiers": tiers, "size": self._payload,
                "tenant": entry.tenant, "created": entry.created,
                "last_access": entry.last_access or entry.created, "pins": entry.pins,
            }

    # ----------------------------------------------------------------------------- state

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier: capacity_bytes, used_bytes, num_blocks, hits, misses, evictions,
        bytes_read, bytes_written, errors."""
        with self._lock:
            out = {HOST: tier_stats(self._counters[HOST], self._host.capacity_bytes,
                                    self._host.num_used, self._host.slot_bytes)}
            if self._disk is not None:
                disk_errors = int(self._disk.stats().get("errors", 0))
                out[DISK] = tier_stats(self._counters[DISK], self._disk.capacity_bytes,
                                       self._disk.num_used, self._disk.slot_bytes, disk_errors)
            return out

    def __len__(self) -> int:
        return len(self._index)

    def check_integrity(self) -> None:
        """Assert the index agrees with the tiers: slot accounting, policies, pins, catalog."""
        with self._lock:
            entries = list(self._index.entries.values())
            host_slots = [e.host_slot for e in entries if e.host_slot is not None]
            assert self._reserved_host >= 0
            for entry in entries:
                assert entry.best_tier is not None, f"block {entry.key.hex()} indexed but in no tier"
                assert entry.pins >= 0 and entry.readers >= 0, f"block {entry.key.hex()} negative counts"
                assert (entry.host_slot is not None) == (entry.key in self._host_policy), (
                    f"block {entry.key.hex()}: host slot and host policy disagree"
                )
                assert (entry.disk_slot is not None) == (entry.key in self._disk_policy), (
                    f"block {entry.key.hex()}: disk slot and disk policy disagree"
                )
            assert len(self._host_policy) == len(host_slots)
            self._host_policy.check_integrity()
            self._disk_policy.check_integrity()
            if self._reserved_host == 0:
                self._host.check_integrity(host_slots)
            if self._disk is not None:
                on_disk = {e.key: e.disk_slot for e in entries if e.disk_slot is not None}
                catalog = {d.key: d.slot for d in self._disk.entries()}
                assert catalog == on_disk, (
                    f"disk catalog ({len(catalog)} blocks) and index ({len(on_disk)} on disk) differ"
                )
                assert len(self._disk_policy) == len(on_disk)
                self._disk.check_integrity()

    def close(self) -> None:
        """Write back what lives only in host RAM, then release the tiers. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=True)
        with self._lock:
            if self._disk is not None:
                # Drain host in eviction order, least valuable first: when the disk is too
                # small, the blocks written last (the most valuable) are the ones that stay.
                entries = self._index.entries
                host_only: list[BlockEntry] = []
                while (key := self._host_policy.pop_victim()) is not None:
                    entry = entries[key]  # type: ignore[index]
                    if entry.disk_slot is None and self._admits(entry):
                        host_only.append(entry)
                keep = host_only[-self._disk.num_slots :][::-1]
                self._write_disk(keep, [self._host.slot_view(e.host_slot) for e in keep])  # type: ignore[arg-type]
                self._disk.close()
            self._host.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------------------------- internals

    def _load_catalog(self) -> None:
        """Rebuild the index from the disk catalog: the catalog is the truth after a restart."""
        assert self._disk is not None
        # newest first: the policy treats the list like a chain and evicts its end first
        found = sorted(self._disk.entries(), key=lambda d: d.last_access, reverse=True)
        for item in found:
            entry = BlockEntry(item.key, None, item.tenant, item.created, disk_slot=item.slot)
            self._index.add(entry)
        self._disk_policy.insert([d.key for d in found], [None] * len(found))

    def _check_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        keys = list(keys)
        for key in keys:
            if not isinstance(key, bytes) or len(key) != self.hasher.key_bytes:
                raise TypeError(
                    f"keys must be {self.hasher.key_bytes}-byte strings from block_keys(), got {key!r:.60}"
                )
        return keys

    def _check_open(self) -> None:
        if self._closed:
            raise KVStoreError("the store is closed")


def _as_bytes(blocks: torch.Tensor, n: int, payload: int) -> torch.Tensor:
    """A contiguous ``[n, *block_shape]`` tensor viewed as ``[n, payload]`` uint8 (no copy)."""
    return blocks.view(torch.uint8).reshape(n, payload) if n else blocks.new_empty((0, payload), dtype=torch.uint8)

