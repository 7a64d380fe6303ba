"""BlockManager: reference counts, the device prefix cache, LRU tail-first eviction, demotion."""

from __future__ import annotations

import threading
import time
from typing import TypeVar

import torch

from kvstore import KVLayout, StoreConfig, TieredStore
from kvstore.engine.block_manager import DEMOTE_RUN, BlockManager
from kvstore.tiers.device import DevicePool

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.float32)


S = TypeVar("S", bound=TieredStore)


def make(num_blocks: int = 6, store_type: type[S] = TieredStore, write_through: bool = False,  # type: ignore[assignment]
         host_blocks: int = 16) -> tuple[BlockManager, S]:
    """A BlockManager over a pool of ``num_blocks`` and a real store of ``store_type``."""
    store = store_type(StoreConfig(layout=LAYOUT, model_id="bm", host_bytes=host_blocks * 4096))
    pool = DevicePool(num_blocks, LAYOUT.block_shape, LAYOUT.dtype)
    return BlockManager(pool, LAYOUT.block_size, store, write_through=write_through), store


def test_allocate_share_release_and_evict_tail_first() -> None:
    bm, store = make()
    keys = store.block_keys(list(range(8)))  # a chain of 4 blocks
    ids = bm.allocate(4)
    assert ids == [0, 1, 2, 3]
    for i, (b, k) in enumerate(zip(ids, keys, strict=True)):
        bm.pool.pool[b].fill_(float(i + 1))
        bm.seal(b, k, keys[i - 1] if i else None, "")
    assert bm.match(keys) == ids and bm.match(store.block_keys([9, 9])) == []
    bm.acquire(ids[:2])  # a second sequence shares the first two blocks
    assert [bm.blocks[b].ref_count for b in ids] == [2, 2, 1, 1]
    bm.release(ids)
    assert list(bm.evictable) == [3, 2] and bm.num_available == 4
    bm.release(ids[:2])
    assert list(bm.evictable) == [3, 2, 1, 0]  # tails first: the chain's head is evicted last
    assert bm.match(keys) == ids  # freed blocks stay findable until their slot is reused
    got = bm.allocate(3)  # 2 free + one eviction: block 3 (the tail) is demoted to the store
    assert got == [4, 5, 3]
    bm.pool.pool[3].fill_(-1.0)  # reused at once: the demotion gathered its bytes before
    assert bm.demoter is not None
    bm.demoter.drain()  # the eviction's put ran on the demoter thread
    assert bm.match(keys) == [0, 1, 2]
    assert store.lookup(keys).num_blocks == 0 and store.contains(keys) == [False, False, False, True]
    assert torch.equal(store.get(keys[3:])[0], torch.full(LAYOUT.block_shape, 4.0))
    bm.release(got)
    bm.check_integrity()
    assert bm.evict_all() == 3
    assert store.contains(keys) == [True, True, True, True]
    assert torch.equal(store.get(keys), torch.stack([torch.full(LAYOUT.block_shape, float(i + 1)) for i in range(4)]))
    bm.check_integrity()
    store.check_integrity()
    store.close()


class GatedStore(TieredStore):
    """A real store whose puts wait for a gate: a slow store, as a loaded disk tier is."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gate = threading.Event()

    def put(self, *args: object, **kwargs: object) -> None:
        assert self.gate.wait(30)
        super().put(*args, **kwargs)  # type: ignore[arg-type]


def test_eviction_does_not_wait_for_the_store() -> None:
    bm, store = make(2, GatedStore)
    keys = store.block_keys(list(range(4)))
    ids = bm.allocate(2)
    for i, b in enumerate(ids):
        bm.pool.pool[b].fill_(float(i + 1))
        bm.seal(b, keys[i], keys[i - 1] if i else None, "")
    bm.release(ids)
    t0 = time.monotonic()
    assert sorted(bm.allocate(2)) == [0, 1]  # evicts both; their put is stuck behind the gate
    assert time.monotonic() - t0 < 5 and bm.stats()["demoting"] == 2
    assert store.contains(keys) == [False, False]
    store.gate.set()
    assert bm.demoter is not None
    bm.demoter.drain()
    assert bm.stats()["demoted"] == 2 and bm.stats()["demoting"] == 0
    assert torch.equal(store.get(keys), torch.stack([torch.full(LAYOUT.block_shape, v) for v in (1.0, 2.0)]))
    bm.close()
    store.close()


def test_demotions_over_the_bound_are_dropped_not_waited_for() -> None:
    bm, store = make(4, GatedStore)
    assert bm.demoter is not None
    bm.demoter.max_pending_bytes = LAYOUT.bytes_per_block  # room for one queued block
    for salt in range(3):  # three separate one-block chains, evicted one at a time
        (b,) = bm.allocate(1)
        bm.seal(b, store.block_keys([salt, 7])[0], None, "")
        bm.release([b])
        bm.evictable.move_to_end(b, last=False)  # this one is evicted next
        bm.allocate(bm.pool.num_free + 1)
        bm.release([i for i in range(4) if bm.blocks[i].ref_count])
    store.gate.set()
    bm.demoter.drain()
    stats = bm.stats()
    assert stats["dropped"] >= 1 and stats["demoted"] + stats["dropped"] == 3, stats
    bm.close()
    store.close()


def test_copy_on_write_and_duplicate_keys() -> None:
    bm, store = make(4)
    (a,) = bm.allocate(1)
    bm.pool.pool[a].fill_(7.0)
    bm.acquire([a])  # two sequences share a partial block
    b = bm.copy_on_write(a)
    assert b != a and bm.blocks[a].ref_count == 1 and bm.blocks[b].ref_count == 1
    assert torch.equal(bm.pool.pool[b], bm.pool.pool[a])
    key = store.block_keys([1, 2])[0]
    bm.seal(a, key, None, "")
    bm.seal(b, key, None, "")  # same content computed twice: the first block keeps the key
    assert bm.cached == {key: a} and bm.blocks[b].key is None
    bm.release([a, b])
    assert list(bm.evictable) == [a] and bm.pool.num_free == 3
    bm.check_integrity()
    store.close()


def seal_chain(bm: BlockManager, keys: list[bytes], first: float = 1.0, computed: bool = True) -> list[int]:
    """Allocate one block per key, fill block i with ``first + i`` and seal the chain."""
    ids = bm.allocate(len(keys))
    for i, (b, k) in enumerate(zip(ids, keys, strict=True)):
        bm.pool.pool[b].fill_(first + i)
        bm.seal(b, k, keys[i - 1] if i else None, "", computed=computed)
    return ids


def filled(*values: float) -> torch.Tensor:
    return torch.stack([torch.full(LAYOUT.block_shape, v) for v in values])


def test_write_through_stores_sealed_blocks_and_their_eviction_puts_nothing() -> None:
    bm, store = make(4, write_through=True)
    keys = store.block_keys(list(range(6)))
    ids = seal_chain(bm, keys)
    assert store.contains(keys) == [False] * 3  # nothing before the step ends
    bm.write_sealed()
    assert bm.demoter is not None
    bm.demoter.drain()
    assert store.contains(keys) == [True] * 3 and bm.match(keys) == ids  # in the store and still on device
    assert torch.equal(store.get(keys), filled(1.0, 2.0, 3.0))
    assert bm.stats()["demoted"] == 3
    bm.release(ids)
    bm.allocate(4)  # evicts all three: the store has them, nothing is gathered or put again
    bm.demoter.drain()
    assert bm.stats()["demoted"] == 3 and bm.stats()["dropped"] == 0
    bm.close()
    store.close()


def test_write_back_stores_nothing_before_eviction() -> None:
    bm, store = make(4)
    keys = store.block_keys(list(range(6)))
    ids = seal_chain(bm, keys)
    bm.write_sealed()
    assert bm.demoter is not None
    bm.demoter.drain()
    assert store.contains(keys) == [False] * 3 and bm.stats()["demoted"] == 0
    bm.release(ids)
    assert bm.evict_all() == 3 and store.contains(keys) == [True] * 3
    bm.close()
    store.close()


def test_eviction_does_not_gather_blocks_a_write_through_holds() -> None:
    bm, store = make(2, GatedStore, write_through=True)
    keys = store.block_keys(list(range(4)))
    ids = seal_chain(bm, keys)
    bm.write_sealed()  # queued; the put waits at the gate
    assert bm.stats()["demoting"] == 2
    bm.release(ids)
    assert sorted(bm.allocate(2)) == [0, 1]  # evicts both while their write-through is queued
    assert bm.stats()["demoting"] == 2  # not gathered again
    bm.pool.pool.fill_(-1.0)  # the blocks are reused: the queued copy is what gets stored
    store.gate.set()
    assert bm.demoter is not None
    bm.demoter.drain()
    assert torch.equal(store.get(keys), filled(1.0, 2.0))
    assert bm.stats()["demoted"] == 2
    bm.close()
    store.close()


def test_fetched_blocks_are_not_written_through() -> None:
    bm, store = make(4, write_through=True)
    keys = store.block_keys(list(range(4)))
    seal_chain(bm, keys, computed=False)  # as a fetch from the store seals them
    bm.write_sealed()
    assert bm.demoter is not None
    bm.demoter.drain()
    assert bm.stats()["demoted"] == 0 and store.contains(keys) == [False, False]
    bm.close()
    store.close()


def test_write_through_over_the_bound_is_skipped_and_demoted_at_eviction() -> None:
    bm, store = make(4, GatedStore, write_through=True)
    assert bm.demoter is not None
    bm.demoter.max_pending_bytes = LAYOUT.bytes_per_block  # room for one queued block
    a, b = store.block_keys([1, 2])[0], store.block_keys([3, 4])[0]  # two one-block chains
    ids = seal_chain(bm, [a]) + seal_chain(bm, [b], first=2.0)
    bm.write_sealed()
    assert bm.stats()["write_through_skipped"] == 1 and bm.stats()["dropped"] == 0  # still on the device
    store.gate.set()
    bm.demoter.drain()
    assert store.contains([a, b]) == [True, False]
    bm.release(ids)
    assert bm.evict_all() == 2
    assert store.contains([a, b]) == [True, True] and torch.equal(store.get([b]), filled(2.0))
    assert bm.stats()["demoted"] == 2 and bm.stats()["dropped"] == 0
    bm.close()
    store.close()


class CountingStore(TieredStore):
    """A real store that records how many blocks each put carried."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.put_sizes: list[int] = []

    def put(self, keys: list[bytes], *args: object, **kwargs: object) -> None:
        self.put_sizes.append(len(keys))
        super().put(keys, *args, **kwargs)  # type: ignore[arg-type]


def test_background_puts_are_short_runs_heads_first() -> None:
    n = DEMOTE_RUN + 4
    bm, store = make(n, CountingStore, write_through=True, host_blocks=64)
    keys = store.block_keys(list(range(2 * n)))
    seal_chain(bm, keys)
    bm.write_sealed()
    assert bm.demoter is not None
    bm.demoter.drain()
    assert store.put_sizes == [DEMOTE_RUN, 4]  # the store's lock is never held for the whole chain
    assert torch.equal(store.get(keys), filled(*[float(i + 1) for i in range(n)]))
    bm.close()
    store.close()
