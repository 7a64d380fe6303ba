"""BlockManager: reference counts, the device prefix cache, LRU tail-first eviction, demotion."""

from __future__ import annotations

import torch

from engine.block_manager import BlockManager
from kvstore import KVLayout, StoreConfig, TieredStore
from tiers.device import DevicePool

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.float32)


def make(num_blocks: int = 6) -> tuple[BlockManager, TieredStore]:
    store = TieredStore(StoreConfig(layout=LAYOUT, model_id="bm", host_bytes=16 * 4096))
    pool = DevicePool(num_blocks, LAYOUT.block_shape, LAYOUT.dtype)
    return BlockManager(pool, LAYOUT.block_size, store), store


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
