"""BlockManager: the device tier. Owns the KV pool's blocks, their reference counts, the device
prefix cache (key -> block) and the LRU of free-but-cached blocks; writes blocks to the store on
the demoter's thread (the engine loop only gathers the bytes): each block right after the step
that filled it (write-through), or, with write-back, when an allocation evicts it.
With KV events (kvstore/engine/device_events.py) it announces the device tier (medium GPU): a
block when it is sealed under its key, its removal when the key leaves the device cache.

A block is in exactly one of three states:
  in use    ref_count > 0 (held by sequences; never evicted or overwritten)
  cached    ref_count == 0, has a key: findable by lookup, in ``evictable`` (LRU first)
  free      ref_count == 0, no key: in the DevicePool's free list
Sequences release their blocks tail first, so a prefix's tail is evicted before its head.

A full block that the step being built computes is findable too, before it is sealed
(``scheduled``, cleared when the next step is built, by then sealed or, after a failed step,
never): a sequence admitted in the same step shares
it instead of computing the same prefix again, as vLLM's scheduler caches a block when it
schedules it. That is safe because every layer writes the step's new K/V into the pool before
any row of the step attends (kvstore/engine/attention.py, kernels.store_kv), and a block a
step computes is held by its sequence until the step is over. A step that fails seals nothing.

A hybrid model (kvstore/engine/groups.py) keeps every layer of a token block in one device
block as well, but the store keeps a block per KV group: a device block goes to the store as
one put per group (its group keys, its group's layers), and ``Block.valid`` says which groups'
layers hold the block's KV (all for a computed block; those fetched, for one filled from the
store).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvstore import kernels
from kvstore.api import BlockStore
from kvstore.engine.demoter import Demoter
from kvstore.engine.device_events import DeviceEvents
from kvstore.engine.groups import DeviceGroups
from kvstore.errors import KVStoreError, TierError
from kvstore.tiers.device import DevicePool

# Blocks per background put: a put holds the store lock while it indexes its blocks and takes
# their slots (and through its copy, below writes.UNLOCKED_COPY_BYTES), and a fetch
# of the request being admitted waits for it; short puts let those in between.
DEMOTE_RUN = 16
# What a put may raise when the store cannot take the blocks: no room, or, under the store's
# write-through, a disk that is full or failing (TierError). A demotion it refuses is dropped
# and counted; it never reaches the engine's caller (evict_device_cache, close).
STORE_REFUSALS = (KVStoreError, TierError)


class Block:
    __slots__ = ("block_id", "key", "parent_key", "ref_count", "tenant", "valid")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.key: bytes | None = None
        self.parent_key: bytes | None = None
        self.tenant = ""
        self.valid = 0  # KV groups whose layers hold the block's KV (a bitmask; set when sealed)


class BlockManager:
    """Device block allocation, sharing and eviction (single-threaded: the engine loop)."""

    def __init__(self, pool: DevicePool, block_size: int, store: BlockStore | None = None, events: DeviceEvents | None = None,
                 write_through: bool = False, groups: DeviceGroups | None = None) -> None:
        self.pool = pool
        self.groups = groups  # a hybrid model's KV groups; None: one group, the device block
        self.block_size = block_size
        self.store = store  # None: evicted blocks are dropped
        self.events = events  # the device tier's KV events (never block), or None
        self.blocks = [Block(i) for i in range(pool.num_blocks)]
        self.cached: dict[bytes, int] = {}
        # full blocks the step being built computes, findable before they are sealed (cleared
        # by ``end_step`` when the scheduler builds the next step): key -> block
        self.scheduled: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.num_demoted = 0
        self.num_dropped = 0
        self.demote_s = 0.0  # seconds the engine loop spent demoting (gathers; puts when synchronous)
        # Puts run on a background thread (bounded: up to the pool's size, at least 64 MiB, of
        # gathered bytes): write-throughs and evictions' demotions; evict_all and write_back wait.
        self.demoter = Demoter(store, max(pool.capacity_bytes, 64 << 20)) if store is not None else None
        # Write-through: blocks sealed by a step, written by write_sealed() after it. Evicting a
        # block the store already holds then costs no gather and no put on the request's path.
        self.write_through = write_through and store is not None
        self._sealed: list[int] = []

    @property
    def all_groups(self) -> int:
        """The bitmask of every KV group (1 for a model of one group)."""
        return self.groups.all_groups if self.groups is not None else 1

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus cached ones it may evict."""
        return self.pool.num_free + len(self.evictable)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Pure query: block ids of the leading run of ``keys`` cached on the device (or
        computed by the step being built)."""
        ids: list[int] = []
        for key in keys:
            block_id = self.cached.get(key, self.scheduled.get(key))
            if block_id is None:
                break
            ids.append(block_id)
        return ids

    def cached_ids(self, keys: Sequence[bytes]) -> list[int | None]:
        """Pure query: per key, its cached device block, or the block the step being built
        computes under it (None where there is neither)."""
        return [self.cached.get(key, self.scheduled.get(key)) for key in keys]

    def schedule(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """The step being built computes these full blocks (held by their sequence): findable
        by ``match`` until ``end_step``, holding every group's KV."""
        for key, b in zip(keys, block_ids, strict=True):
            block = self.blocks[b]
            if block.key is None and key not in self.cached:
                self.scheduled.setdefault(key, b)
                block.valid = self.all_groups

    def end_step(self) -> None:
        """The last step is over (its blocks computed and sealed, or it failed): only sealed
        blocks stay findable. The scheduler calls it before it builds a step."""
        self.scheduled.clear()

    def num_reusable(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` are cached but unreferenced (acquiring them uses availability)."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each block (device prefix hits, forked samples)."""
        for b in block_ids:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.evictable[b]
            block.ref_count += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with one reference each; evicts cached blocks LRU first if needed."""
        if n > self.num_available:
            raise KVStoreError(f"need {n} device blocks, {self.num_available} available of {self.pool.num_blocks}")
        short = n - self.pool.num_free
        if short > 0:
            self._evict(short)
        ids = self.pool.allocate(n)
        for b in ids:
            self.blocks[b].ref_count = 1
        return ids

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference of each block, tail first: keyed blocks stay cached, others free."""
        freed: list[int] = []
        for b in reversed(block_ids):
            block = self.blocks[b]
            assert block.ref_count > 0, f"block {b} released more often than acquired"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.key is not None:
                    self.evictable[b] = None
                else:
                    freed.append(b)
        self.pool.release(freed)

    def seal(self, block_id: int, key: bytes, parent_key: bytes | None, tenant: str,
             token_ids: Sequence[int] | None = None, computed: bool = True, valid: int | None = None) -> None:
        """Publish a full block under its key (``token_ids``: its tokens, for the KV events;
        ``computed``: False for a block fetched from the store, which write-through skips;
        ``valid``: the KV groups it holds, default all). A key already cached elsewhere keeps
        that block; this one stays private and is freed with its sequence."""
        block = self.blocks[block_id]
        if block.key is not None or key in self.cached:
            return
        block.key, block.parent_key, block.tenant = key, parent_key, tenant
        block.valid = valid if valid is not None else self.all_groups
        self.cached[key] = block_id
        if computed and self.write_through:
            self._sealed.append(block_id)
        if self.events is not None:
            self.events.stored(key, parent_key, token_ids, block.valid)

    def copy_on_write(self, block_id: int) -> int:
        """A private copy of a shared block (the caller's reference moves to the copy)."""
        (new,) = self.allocate(1)
        self.pool.pool[new].copy_(self.pool.pool[block_id])
        self.release([block_id])
        return new

    def _evict(self, n: int, background: bool = True) -> None:
        victims = [self.evictable.popitem(last=False)[0] for _ in range(n)]
        self._demote(victims, background)
        gone: list[tuple[bytes, int]] = []
        for b in victims:
            block = self.blocks[b]
            gone.append((block.key, block.valid))  # type: ignore[arg-type]  # a cached block has a key
            del self.cached[block.key]  # type: ignore[arg-type]
            block.key = block.parent_key = None
            block.valid = 0
        self.pool.release(victims)
        if self.events is not None:
            self.events.removed(gone)

    def evict_all(self) -> int:
        """Push every cached-but-unused block out of the device (to the store); returns how many."""
        n = len(self.evictable)
        if n:
            self._evict(n, background=False)
        return n

    def write_back(self) -> None:
        """Copy every keyed block the store lacks to the store, keeping it on the device."""
        self._demote([b.block_id for b in self.blocks if b.key is not None], background=False)

    def write_sealed(self) -> None:
        """Write-through: queue the blocks sealed since the last call for the store (the engine
        calls it after each step). Over the demoter's bound they are skipped, not lost: a block
        the store lacks is still demoted when it is evicted."""
        if self._sealed:
            ids, self._sealed = self._sealed, []
            self._demote([b for b in reversed(ids) if self.blocks[b].key is not None], background=True,
                         optional=True)

    def close(self) -> None:
        """Finish the background demotions and stop their thread."""
        if self.demoter is not None:
            self.demoter.close()

    def _demote(self, block_ids: list[int], background: bool, optional: bool = False) -> None:
        """Put the blocks' bytes in the store, one put per chain run, or per DEMOTE_RUN blocks of
        it in the background (heads before tails; the ids come tail first).

        ``background``: gather the bytes now and leave the puts to the demoter thread;
        otherwise put them now, after the demotions queued before. ``optional``: the blocks
        stay on the device (write-through), so a run over the demoter's bound is not counted
        as dropped.
        """
        if self.store is None or not block_ids:
            self.num_dropped += len(block_ids) if self.store is None else 0
            return
        if self.groups is not None and not self.groups.trivial:
            t0 = time.perf_counter()
            try:
                self._demote_groups(block_ids, background, optional)
            finally:
                self.demote_s += time.perf_counter() - t0
            return
        t0 = time.perf_counter()
        try:
            if background and self.demoter is not None:
                for run in self._runs(self._unstored(block_ids)):
                    for i in range(0, len(run), DEMOTE_RUN):
                        part = run[i : i + DEMOTE_RUN]
                        self.demoter.submit([b.key for b in part], self._gather(part), part[0].tenant,  # type: ignore[misc]
                                            optional)
            else:
                if self.demoter is not None:
                    self.demoter.drain()  # keep the order: heads queued before are stored first
                self._demote_now(block_ids)
        finally:
            self.demote_s += time.perf_counter() - t0

    @staticmethod
    def _runs(blocks: list[Block]) -> list[list[Block]]:
        """Chain runs of ``blocks`` (given tail first, in eviction order), heads first."""
        runs: list[list[Block]] = []
        for b in reversed(blocks):
            if runs and runs[-1][-1].key == b.parent_key and runs[-1][-1].tenant == b.tenant:
                runs[-1].append(b)
            else:
                runs.append([b])
        return runs

    def _unstored(self, block_ids: list[int]) -> list[Block]:
        """The blocks whose bytes no queued run holds (a write-through's) and the store lacks.
        The store is asked only about the others: its lock may be held by a long put."""
        blocks = [self.blocks[b] for b in block_ids]
        queued = self.demoter.queued([b.key for b in blocks]) if self.demoter is not None else [False] * len(blocks)  # type: ignore[misc]
        ask = _keys([b for b, q in zip(blocks, queued, strict=True) if not q])
        assert self.store is not None  # only called with a store
        held = iter(self.store.contains(ask) if ask else ())
        return [b for b, q in zip(blocks, queued, strict=True) if not q and not next(held)]

    def _gather(self, run: list[Block]) -> torch.Tensor:
        """A copy of the blocks' bytes out of the pool (they may be reused right after)."""
        return kernels.gather_blocks(self.pool.pool, torch.tensor([b.block_id for b in run], dtype=torch.long))

    def _demote_now(self, block_ids: list[int]) -> None:
        assert self.store is not None  # only called with a store
        for run in self._runs(self._unstored(block_ids)):
            try:
                self.store.put(_keys(run), self._gather(run), tenant=run[0].tenant)
                self.num_demoted += len(run)
            except STORE_REFUSALS:  # the store is full (of pinned or in-flight blocks, or its disk is)
                self.num_dropped += len(run)

    def _demote_groups(self, block_ids: list[int], background: bool, optional: bool) -> None:
        """``_demote`` of a hybrid model: per chain run and KV group, one put of the group's
        layers under the group's keys (only the groups a block holds and the store lacks)."""
        assert self.store is not None and self.groups is not None
        store, groups = self.store, self.groups
        if not background and self.demoter is not None:
            self.demoter.drain()  # keep the order: heads queued before are stored first
        missing = self._missing_groups(block_ids)
        for run in self._runs([self.blocks[b] for b in block_ids if missing.get(b)]):
            for g in range(groups.num_groups):
                for part in _consecutive([b for b in run if missing[b.block_id] >> g & 1]):
                    keys = store.group_keys(_keys(part), g)
                    data = groups.gather(self.pool.pool, [b.block_id for b in part], g)
                    if background and self.demoter is not None:
                        self.demoter.submit(keys, data, part[0].tenant, optional, group=g, tags=_keys(part))
                        continue
                    try:  # counted in group blocks, as the demoter counts them
                        store.put(keys, data, tenant=part[0].tenant, group=g)
                        self.num_demoted += len(part)
                    except STORE_REFUSALS:
                        self.num_dropped += len(part)

    def _missing_groups(self, block_ids: list[int]) -> dict[int, int]:
        """Per block (not queued for the store already), the groups it holds that the store
        lacks, as a bitmask."""
        assert self.store is not None and self.groups is not None
        blocks = [self.blocks[b] for b in block_ids if self.blocks[b].key is not None]
        queued = self.demoter.queued(_keys(blocks)) if self.demoter is not None else [False] * len(blocks)
        ask = [b for b, q in zip(blocks, queued, strict=True) if not q]
        out: dict[int, int] = {}
        for g in range(self.groups.num_groups):
            holders = [b for b in ask if b.valid >> g & 1]
            if not holders:
                continue
            held = self.store.contains(self.store.group_keys(_keys(holders), g))
            for b, h in zip(holders, held, strict=True):
                if not h:
                    out[b.block_id] = out.get(b.block_id, 0) | 1 << g
        return out

    def cool(self, chain_keys: Sequence[bytes], group: int) -> None:
        """Tell the store that group ``group``'s blocks of these prefixes serve only hits at
        other boundaries (``BlockStore.cool``), after the puts queued before."""
        if self.store is None or not chain_keys:
            return
        keys = self.store.group_keys(list(chain_keys), group)
        if self.demoter is not None:
            self.demoter.cool(keys)
        else:
            self.store.cool(keys)

    def held_blocks(self) -> list[tuple[bytes, bytes | None, int]]:
        """(key, parent key, valid groups) of every block in the device prefix cache. Safe to
        call from another thread (the KV-event snapshot): it copies the map in one step."""
        items = list(self.cached.items())
        blocks = self.blocks
        return [(key, blocks[b].parent_key, blocks[b].valid) for key, b in items]

    def stats(self) -> dict[str, int]:
        d = self.demoter
        in_use = sum(1 for b in self.blocks if b.ref_count > 0)
        bpb = self.pool.bytes_per_block
        return {"capacity_bytes": self.pool.capacity_bytes, "used_bytes": (in_use + len(self.evictable)) * bpb,
                "num_blocks": in_use + len(self.evictable), "num_in_use": in_use, "num_cached": len(self.cached),
                "num_free": self.pool.num_free, "demoted": self.num_demoted + (d.num_demoted if d else 0),
                "dropped": self.num_dropped + (d.num_dropped if d else 0), "demoting": d.num_pending if d else 0,
                "write_through_skipped": d.num_skipped if d else 0}

    def check_integrity(self) -> None:
        used = [b.block_id for b in self.blocks if b.ref_count > 0 or b.key is not None]
        self.pool.check_integrity(used)
        for key, b in self.cached.items():
            assert self.blocks[b].key == key, f"cached key of block {b} disagrees"
        for b in self.evictable:
            assert self.blocks[b].ref_count == 0 and self.blocks[b].key is not None, f"block {b} wrongly evictable"
        assert sum(1 for b in self.blocks if b.ref_count == 0 and b.key is not None) == len(self.evictable)


def _keys(blocks: list[Block]) -> list[bytes]:
    """The keys of blocks that have one (cached, or sealed for the store)."""
    keys = [b.key for b in blocks]
    assert None not in keys
    return keys  # type: ignore[return-value]


def _consecutive(blocks: list[Block]) -> list[list[Block]]:
    """``blocks`` (one chain's, in order, some left out) as runs whose each block chains the one
    before it."""
    runs: list[list[Block]] = []
    for b in blocks:
        if runs and b.parent_key == runs[-1][-1].key:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs

