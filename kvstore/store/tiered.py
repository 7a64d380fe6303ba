"""TieredStore: the embedded API over the cascade of levels (host RAM, disk, remote, ...).

The store builds the levels from its config and hands them to a ``Cascade`` (the level list,
the index, demotion and promotion); ``WritePath`` and ``ReadPath`` run put and get over it,
``Management`` and ``TenantForget`` the operator's calls, ``HostLeases`` (``host_leases``)
gives the daemon zero-copy host slots and ``StoreView`` (``view``) read-only snapshots. Every
index mutation happens under the cascade's lock; bulk copies of blocks being read run outside
it, held by ``InFlight`` (a block being read is never evicted).

Each method is a short delegate to one of those parts; the module is longer than most (about
450 lines) because it is the contract's implementation: its docstrings say what the embedded
store adds to ``BlockStore``'s (what each call raises, when it waits, what ``exact`` does).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, overload

import numpy as np
import torch

from kvstore.api import BlockStore
from kvstore.config import StoreConfig
from kvstore.keys import BlockHasher, ExtraKey, Namespace
from kvstore.layout import raw_rows
from kvstore.policy.quotas import QuotaTable
from kvstore.results import BlockInfo, FetchHandle, FetchResult, ForgetReport, PrefetchHandle, PrefixMatch
from kvstore.store.cascade import Cascade
from kvstore.store.demotions import budget as staging_budget
from kvstore.store.forget import FORGET_WAIT_S, TenantForget
from kvstore.store.inspection import StoreView
from kvstore.store.integrity import check_integrity
from kvstore.store.leases import HostLeases
from kvstore.store.levels import Level, SharedLevel
from kvstore.store.levels.build import build_admissions, build_levels, build_shared
from kvstore.store.levels.codec_choice import resolve_disk_codec
from kvstore.store.listeners import StoreListener
from kvstore.store.management import Management
from kvstore.store.reads import ReadPath
from kvstore.store.writes import HostWrite, WritePath
from kvstore.tiers.records import check_name

# Lookups made while another thread held the store lock wait in a queue to be counted (see
# lookup); past this many, the next lookup waits for the lock once and counts them.
MAX_UNCOUNTED_LOOKUPS = 4096


class TieredStore:
    """A KV block store over host RAM, optionally local disk, and optionally a remote tier
    shared with other stores. Thread-safe.

    Invariants kept here: a read never returns bytes other than those put under its key;
    each tier's capacity is a hard limit; a pinned block or one being read is never evicted.
    """

    def __init__(self, config: StoreConfig) -> None:
        config = resolve_disk_codec(config)  # disk_codec="auto": the directory's choice
        self.config = config
        self.layout = config.layout
        self.namespace = Namespace(config.model_id, config.layout, config.settings.hash_algo)
        self.hasher = BlockHasher(self.namespace)
        self._payload = self.layout.bytes_per_block
        self._cascade = cascade = Cascade(build_levels(config, self.namespace), build_shared(config),
                                          staging_budget(config.settings.host_bytes),
                                          demote_cold=config.settings.cold_blocks == "demote")
        build_admissions(config, cascade.levels, cascade.shared)  # disk_admission, remote_admission
        self._lock = cascade.lock
        self._index = cascade.index
        self._writes = WritePath(cascade, write_through=config.settings.write_policy == "write_through")
        self._reads = ReadPath(cascade, promote=config.settings.promotion != "never")
        self._leases = HostLeases(cascade, self._reads, self._writes, self._check_keys)
        self._view = StoreView(cascade, self._payload)
        self._codings = [level.coding for level in cascade.levels if level.coding is not None]
        self._executor = ThreadPoolExecutor(config.transfer_threads, thread_name_prefix="kvstore-transfer")
        self._manage = Management(cascade, self._reads, self._executor, self._view.codecs)
        self._forget = TenantForget(cascade, self._reads, self._manage.pins)
        for shared in cascade.shared:
            shared.watch(functools.partial(self._shared_stored, shared.name))

    @property
    def levels(self) -> tuple[str, ...]:
        """The tier names of the cascade, fastest first ("host", then "disk" and "remote" when
        configured)."""
        return self._cascade.level_names

    def level(self, name: str) -> Level | SharedLevel | None:
        """The level called ``name`` (its medium, policy and counters), for inspection."""
        return self._cascade.level(name)

    # ----------------------------------------------------------------------------- keys

    def block_keys(
        self,
        token_ids: Sequence[int] | np.ndarray,
        tenant: str = "",
        extra_keys: Sequence[Sequence[ExtraKey] | None] | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """One chained key per full block of ``token_ids`` (see kvstore.keys.BlockHasher)."""
        if self._cascade.shared:
            self.know_tenant(tenant)
        return self.hasher.block_keys(token_ids, tenant, extra_keys, parent)

    def group_keys(self, keys: Sequence[bytes], group: int) -> list[bytes]:
        """KV group ``group``'s keys of the prefixes ``keys`` name (kvstore.keys.BlockHasher)."""
        return self.hasher.group_keys(keys, group)

    def know_tenant(self, tenant: str) -> None:
        """``tenant`` uses this store: blocks of its that the remote tier delivers are filed
        under its name (block_keys and puts tell it already; the daemon tells it at hello)."""
        for shared in self._cascade.shared:
            shared.know_tenant(tenant)

    # ----------------------------------------------------------------------------- writes

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor, *, tenant: str = "", group: int | None = None) -> None:
        """Store ``blocks[i]`` under ``keys[i]``; keys are one chain, in prefix order. ``group``:
        the KV group the blocks are of (their KV events say so; None: not said).

        Blocks land in host RAM (and on disk before returning under write-through). A key the
        store already holds is only refreshed: equal keys mean equal bytes.

        Raises:
            LayoutMismatchError: wrong shape, dtype or count.
            ValueError: ``tenant`` is not a str of at most 255 UTF-8 bytes.
            CodecError: a tier's lossy codec could not store a block (NaN or Inf in it, or a
                value past the codec's range); nothing is stored.
            CapacityError: host RAM has no evictable slot left (everything pinned or in flight),
                or under write-through the disk has none.
            TierError: under write-through, the disk failed to store the blocks (TierFullError:
                no space; TierIOError: I/O or catalog failure).
            Under write-through, a put that raises is not acknowledged: its blocks that did not
            reach the disk are not kept in any tier (WritePath.put).
        """
        keys = self._check_keys(keys)
        _check_tenant(tenant)
        src = self.layout.input_blocks(blocks, len(keys))
        for coding in self._codings:  # refused now, not at a later demotion
            coding.check_encodable(blocks)
        # A put bigger than host RAM goes in chunks, tails first: the head chunk is stored last,
        # so it ends up the most recent and a prefix's tail is what gets demoted.
        chunk = max(1, self._cascade.host.num_slots // 2)
        cascade = self._cascade
        for start in reversed(range(0, len(keys), chunk)):
            stop = min(len(keys), start + chunk)
            try:
                with self._lock:
                    cascade.inflight.wait_written(keys[start:stop])  # another put or a demotion writing some
                    cascade.check_open()
                    pending = self._writes.put(keys, start, stop, src, tenant, group)
                if isinstance(pending, HostWrite):  # a big put's copy, outside the lock: its blocks
                    self._writes.finish(pending)  # are published before the demotions are written down
                    pending = None
            finally:
                cascade.write_owed()  # disk writes of the demotions it made room with, lock free
            if pending is not None:  # write-through: the disk write, outside the lock
                self._writes.finish(pending)

    # ----------------------------------------------------------------------------- reads

    def lookup(self, keys: Sequence[bytes], *, exact: bool = False) -> PrefixMatch:
        """Pure query: the leading run of ``keys`` that some tier holds, where, and whether
        that copy is lossy (``PrefixMatch.lossy``); with ``exact``, the run of blocks held
        as the bytes put.

        Changes no recency and no placement, and does not wait for the store's lock (another
        thread's put may hold it through a large copy): a hint, as a block may leave before
        the get that follows. A block on its way into a tier (a write-through put's, a
        demotion's) is reported there; a get waits for it. Where the local run ends, a remote tier is asked
        for the blocks that follow (one round trip per node; its tier is "remote"). With
        ``promotion="lookup"`` it also starts an asynchronous copy of the matched lower-tier
        blocks up to host (a prefetch hint).
        """
        keys = self._check_keys(keys)
        cascade = self._cascade
        # (a backlog of uncounted lookups, only when the lock is never free, waits once for it)
        with cascade.locked(blocking=cascade.lookups.num_uncounted >= MAX_UNCOUNTED_LOOKUPS) as held:
            cascade.check_open()
            # Another thread holds the lock, maybe for milliseconds (a put copying a large
            # batch in): the index is read without it. Every read of it is atomic, and a lookup
            # is a hint: a block being put may show a moment before its bytes are readable (a
            # get then waits for them, or misses if the put fails), as one may leave between a
            # lookup and the get that follows it.
            match = self._index.match(keys, exact=exact)
            if held:
                cascade.lookups.count(match.tiers, len(keys), cascade.index.chain_tenant(keys))
            else:
                cascade.lookups.count_later(match.tiers, len(keys), cascade.index.chain_tenant(keys))
        if cascade.shared and match.num_blocks < len(keys):
            match = self._reads.extend(keys, match, exact)
        host = self._cascade.host.name
        if self.config.settings.promotion == "lookup" and any(t != host for t in match.tiers):
            lower = [k for k, t in zip(keys, match.tiers, strict=False) if t != host]
            self._executor.submit(self._reads.read_into, lower, None)
        return match

    def get(self, keys: Sequence[bytes], out: torch.Tensor | None = None, *, exact: bool = False) -> torch.Tensor:
        """The blocks under ``keys`` as a CPU tensor ``[len(keys), *block_shape]``.

        A block read from a tier with a lossy codec (``*_codec="int8"``...) comes back as the
        codec's decoded values, not the bytes put; ``exact=True`` treats a block held only
        that way as missing.

        Args:
            keys: one chain, in prefix order.
            out: optional contiguous CPU tensor of that shape and the layout's dtype to fill.
            exact: only the bytes put count as a hit.

        Raises:
            KeyError: naming the first key no tier holds (a corrupt block counts as missing,
                and with ``exact`` so does a lossy copy).
        """
        keys = self._check_keys(keys)
        out = self.layout.output_blocks(len(keys), out)
        result = self._reads.read_into(keys, out, count=True, exact=exact)
        if result.num_blocks < len(keys):
            raise KeyError(f"block {keys[result.num_blocks].hex()} (#{result.num_blocks}) is not in the store")
        return out

    def fetch(self, keys: Sequence[bytes], into: torch.Tensor, *, exact: bool = False) -> FetchHandle:
        """Copy the blocks under ``keys`` into ``into`` asynchronously.

        Args:
            keys: one chain, in prefix order.
            into: a contiguous tensor ``[len(keys), *block_shape]`` of the layout's dtype,
                on any device; it must stay alive until the handle is done.
            exact: as for ``get``: a block held only as a lossy copy ends the run.

        Returns:
            A handle whose result() is a FetchResult: the leading run of blocks delivered.
        """
        keys = self._check_keys(keys)
        self.layout.check_blocks(into, len(keys))
        if not into.is_contiguous():
            raise ValueError("fetch(into=...) needs a contiguous tensor")
        self._cascade.check_open()
        if into.device.type == "cpu":
            return FetchHandle(self._executor.submit(self._reads.read_into, keys, into, exact=exact), len(keys))

        def to_device() -> FetchResult:
            staging = torch.empty((len(keys), self._payload), dtype=torch.uint8,
                                  pin_memory=self._cascade.host.pinned)
            result = self._reads.read_into(keys, staging, exact=exact)
            n = result.num_blocks
            raw_rows(into)[:n].copy_(staging[:n], non_blocking=True)
            torch.cuda.current_stream(into.device).synchronize()
            return result

        return FetchHandle(self._executor.submit(to_device), len(keys))

    @overload
    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...
    @overload
    def contains(self, keys: Sequence[bytes], *, blocking: bool) -> list[bool] | None: ...

    def contains(self, keys: Sequence[bytes], *, blocking: bool = True) -> list[bool] | None:
        """Pure query, per key (not only the leading run): does a local tier hold it? The
        remote tier is not asked (``lookup`` does that for a chain). With ``blocking=False``,
        None when the store lock is busy."""
        keys = self._check_keys(keys)
        with self._cascade.locked(blocking) as held:
            if not held:
                return None
            entries = self._index.entries
            # a block held nowhere is being written (a put, a demotion): held, as a lookup says
            return [(e := entries.get(k)) is not None and (e.writing or e.is_held) for k in keys]

    def delete(self, keys: Sequence[bytes], *, descendants: bool = False) -> int:
        """Remove blocks from every tier; returns how many were held. Absent keys are skipped.
        With ``descendants``, also every block chained below one of them that the index links
        to its parent (kvstore/store/management.py); the remote tier is asked to delete those too.

        Raises:
            CapacityError: a block is pinned or being read (nothing is deleted then).
        """
        keys = self._check_keys(keys)
        num_deleted, doomed = self._manage.delete(keys, descendants)
        for level in self._cascade.shared:
            level.discard(doomed)
        return num_deleted

    def cool(self, keys: Sequence[bytes]) -> int:
        """Make the blocks of ``keys`` every tier's next victims (under ``cold_blocks="drop"``
        never written down the tiers); a later read or put warms them. How many were held."""
        keys = self._check_keys(keys)
        with self._lock:
            self._cascade.check_open()
            return self._cascade.cool(keys)

    # ----------------------------------------------------------------------------- pins

    def pin(self, keys: Sequence[bytes], *, ttl_s: float | None = None, holder: int | None = None) -> None:
        """Protect blocks from eviction in every tier until unpinned (KeyError if absent), or
        with ``ttl_s`` until then at the latest: the pin ends by itself (kvstore/store/pins.py).
        ``holder``: who holds the pins (a daemon connection's id; ``end_pins`` ends them all)."""
        self._manage.pin(self._check_keys(keys), ttl_s, holder)

    def unpin(self, keys: Sequence[bytes], *, holder: int | None = None) -> None:
        """Undo the most recent pin of each key (of ``holder``'s when named). ValueError for a
        key that is not pinned."""
        self._manage.unpin(self._check_keys(keys), holder)

    def end_pins(self, holder: int) -> int:
        """End every pin ``holder`` holds (its connection closed); how many there were."""
        return self._manage.end_pins(holder)

    # ----------------------------------------------------------------------------- management

    def prefetch(self, keys: Sequence[bytes]) -> PrefetchHandle:
        """Bring the blocks up to host RAM ahead of a read, in the background: returns at once;
        ``result()`` is how many of them host RAM holds once done. ValueError past
        ``management.MAX_KEYS`` keys, before any work."""
        return self._manage.prefetch(self._check_keys(keys))

    def inspect(self, keys: Sequence[bytes]) -> list[BlockInfo | None]:
        """Per key, which tiers hold its block, with what codec and size, its tenant and pins
        (None for a block no tier holds). Asks the remote tier (one round trip)."""
        return self._manage.inspect(self._check_keys(keys))

    def forget_tenant(self, tenant: str, *, remote: bool = True, wait_s: float = FORGET_WAIT_S) -> ForgetReport:
        """Delete every block of ``tenant`` from every tier (pinned ones, ones being read once
        their readers are done, the remote tier's whoever wrote them; durably: a restart
        recovers none). Returns the count per tier (kvstore/store/forget.py).

        Raises:
            ValueError: ``tenant`` is not a tenant name (a str of at most 255 UTF-8 bytes).
            CapacityError: some of its blocks were still being read after ``wait_s``.
        """
        return self._forget.forget(tenant, remote=remote, wait_s=wait_s)

    # ----------------------------------------------------------------------------- leases

    @property
    def host_leases(self) -> HostLeases:
        """Zero-copy access to host RAM's slots, for the daemon's shared-memory clients and its
        socket puts and gets: read leases, reserved slots, commits (kvstore/store/leases.py)."""
        return self._leases

    # ----------------------------------------------------------------------------- events

    def add_listener(self, listener: StoreListener) -> None:
        """Tell ``listener`` whenever a tier starts or stops holding a block (kvstore.store.listeners)."""
        with self._lock:
            self._cascade.listeners.add(listener)

    def remove_listener(self, listener: StoreListener) -> None:
        with self._lock:
            self._cascade.listeners.remove(listener)

    def _shared_stored(self, tier: str, keys: list[bytes]) -> None:
        """Blocks this store offered are in shared level ``tier`` now: tell the listeners (KV
        events, medium REMOTE). Parents are not known there, and removals are not reported
        (the medium evicts on its own, unseen), so a block written again after Redis evicted
        it is announced again."""
        with self._lock:
            self._cascade.listeners.stored(tier, keys, [None] * len(keys))

    # ----------------------------------------------------------------------------- inspection

    @property
    def view(self) -> StoreView:
        """Read-only snapshots of the store for REST, metrics, KV-event snapshots and tests:
        held keys, one block's detail, blocks per tier, codecs, remote nodes, usage per tenant
        (kvstore/store/inspection.py). None changes recency or placement."""
        return self._view

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier: occupancy, counters, codec (see StoreView.stats for every field)."""
        return self._view.stats()

    # ----------------------------------------------------------------------------- tenants
    # Quotas (kvstore/policy/quotas.py) and usage per tenant (kvstore/store/usage.py).

    def set_quotas(self, table: QuotaTable) -> None:
        """Put ``table``'s quotas in force now (at run time; the next eviction obeys them).

        Raises:
            ConfigError: a tier the store does not have, or a hard quota on a tier other
                than host RAM (nothing changes then).
        """
        table.check_tiers(level.name for level in self._cascade.levels)
        with self._lock:
            self._cascade.quota.set(table)

    @property
    def quotas(self) -> QuotaTable:
        """The quotas in force (an empty table: none)."""
        return self._cascade.quota.table

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block offered to the remote tier so far is written there or counted
        as dropped. True when done (always, without a remote tier); False on timeout."""
        return all([level.flush(timeout) for level in self._cascade.shared])

    def __len__(self) -> int:
        return len(self._index)

    def check_integrity(self) -> None:
        """Assert the index agrees with the tiers: slot accounting, policies, pins, catalog."""
        with self._lock:
            check_integrity(self._cascade)
            self._manage.check()

    def close(self) -> None:
        """Write back what lives only in host RAM, then release the tiers. Idempotent."""
        with self._lock:
            if self._cascade.closed:
                return
            self._cascade.closed = True
            self._cascade.inflight.wait_all_written()  # write-through puts and deferred demotions first
        self._executor.shutdown(wait=True)
        self._manage.close()
        with self._lock:
            self._cascade.write_back()
            for level in reversed(self._cascade.levels):
                level.close()
        for shared in self._cascade.shared:
            shared.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------------------------- internals

    def _check_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        keys = list(keys)
        n = self.hasher.key_bytes
        # the common case in two C-level passes; the loop below only names the bad key
        if keys and (set(map(type, keys)) != {bytes} or set(map(len, keys)) != {n}):
            for key in keys:
                if not isinstance(key, bytes) or len(key) != n:
                    raise TypeError(f"keys must be {n}-byte strings from block_keys(), got {key!r:.60}")
        return keys


def _check_tenant(tenant: str) -> None:
    """Refuse a tenant the disk catalog could not record (it would fail a later demotion)."""
    check_name("tenant", tenant)


def _implements_the_contract(store: TieredStore) -> BlockStore:
    return store  # mypy checks that TieredStore is a BlockStore, signature by signature
