"""TieredStore: placement, exact eviction order, pins, promotion, policies, restart, bad input."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from kvstore import (
    CapacityError,
    ConfigError,
    KVLayout,
    KVStoreError,
    LayoutMismatchError,
    StoreConfig,
    TieredStore,
)
from kvstore.errors import CodecError, TierError

from factories import SLOT, SMALL_LAYOUT, blocks_for, chain, make_store


def assert_exact(store, keys):  # type: ignore[no-untyped-def]
    assert keys, "nothing to compare"
    got = store.get(keys)
    want = blocks_for(keys)
    assert torch.equal(got, want), "store returned bytes other than those put"


def test_put_get_lookup_roundtrip(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=8)
    keys = chain(store, 3)
    assert store.lookup(keys).num_blocks == 0
    store.put(keys, blocks_for(keys))
    m = store.lookup(keys)
    assert (m.num_blocks, m.tiers) == (3, ("host", "host", "host"))
    assert_exact(store, keys)
    other = chain(store, 2, salt=1)
    assert store.lookup(keys[:1] + other).num_blocks == 1  # stops at the first miss
    stats = store.stats()
    assert stats["host"]["num_blocks"] == 3
    assert stats["host"]["used_bytes"] == 3 * SLOT
    assert stats["host"]["capacity_bytes"] == 8 * SLOT
    assert "disk" not in stats
    store.check_integrity()
    store.close()


def test_get_names_first_missing_key(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    keys = chain(store, 3)
    store.put(keys[:1], blocks_for(keys[:1]))
    with pytest.raises(KeyError, match=keys[1].hex()):
        store.get(keys)


def test_host_eviction_demotes_tails_first_to_disk(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=8, host_policy="lru", disk_policy="lru")
    a = chain(store, 4, salt=1)
    b = chain(store, 2, salt=2)
    store.put(a, blocks_for(a))
    store.put(b, blocks_for(b))
    # Two slots were needed: A's two tail blocks left host for disk, A's head stayed.
    assert store.lookup(a).tiers == ("host", "host", "disk", "disk")
    assert store.lookup(b).tiers == ("host", "host")
    assert store.stats()["host"]["evictions"] == 2
    assert store.stats()["disk"]["num_blocks"] == 2
    store.check_integrity()
    # Disk keeps the same order: with 8 disk slots and room for 2 more, put C (4 blocks):
    # host must evict 4 (b1, b0 were used after a1, a0 -> a1, a0 go first, then b1, b0).
    c = chain(store, 4, salt=3)
    store.put(c, blocks_for(c))
    assert store.lookup(a).tiers == ("disk", "disk", "disk", "disk")
    assert store.lookup(b).tiers == ("disk", "disk")
    # Disk is full (6 of 8 used + 4 incoming would exceed): next put drops disk's LRU tails.
    d = chain(store, 4, salt=4)
    store.put(d, blocks_for(d))
    assert store.stats()["disk"]["num_blocks"] == 8
    assert store.lookup(a).num_blocks == 2  # a3, a2 were the oldest tails on disk
    assert_exact(store, d)
    for keys in (c, b, a):  # reads promote (and so demote others): whatever is found is exact
        found = store.lookup(keys).num_blocks
        if found:
            assert_exact(store, keys[:found])
    store.check_integrity()
    store.close()


def test_a_found_head_outlives_the_new_tail_put_after_it(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=3, host_policy="lru")
    keys = chain(store, 3)
    store.put(keys[:1], blocks_for(keys[:1]))
    store.put(keys[:2], blocks_for(keys[:2]))  # head found and refreshed, one new tail
    other = chain(store, 2, salt=5)
    store.put(other, blocks_for(other))  # needs one slot: the tail goes, not the head
    assert store.lookup(keys).tiers == ("host",)
    store.check_integrity()


def test_capacity_is_a_hard_limit_with_puts_larger_than_host(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=6)
    keys = chain(store, 20)
    store.put(keys, blocks_for(keys))
    stats = store.stats()
    assert stats["host"]["num_blocks"] == 4 and stats["disk"]["num_blocks"] == 6
    assert stats["host"]["used_bytes"] <= stats["host"]["capacity_bytes"]
    assert stats["disk"]["used_bytes"] <= stats["disk"]["capacity_bytes"]
    store.check_integrity()
    store.close()


def test_pinned_blocks_are_never_evicted(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=3)
    a = chain(store, 2, salt=1)
    store.put(a, blocks_for(a))
    store.pin(a)
    b = chain(store, 3, salt=2)
    store.put(b, blocks_for(b))  # one unpinned slot left: b cycles through it, tail first
    assert store.lookup(a).tiers == ("host", "host")
    assert store.lookup(b).tiers == ("host",)  # the head stayed
    store.pin(b[:1])
    c = chain(store, 1, salt=3)
    with pytest.raises(CapacityError, match=r"need 1 host slots, 0 free of 3 \(the rest pinned"):
        store.put(c, blocks_for(c))
    assert store.lookup(c).num_blocks == 0  # the failed put left nothing behind
    store.unpin(a + b[:1])
    with pytest.raises(ValueError, match="not pinned"):
        store.unpin(a)
    store.put(b, blocks_for(b))
    assert store.lookup(a).num_blocks == 0  # unpinned, then evicted (no disk tier: dropped)
    store.check_integrity()


def test_pin_of_absent_key_raises(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    with pytest.raises(KeyError):
        store.pin(chain(store, 1))


def test_get_promotes_disk_blocks_to_host(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=2, disk_blocks=8)
    a, b = chain(store, 2, salt=1), chain(store, 2, salt=2)
    store.put(a, blocks_for(a))
    store.put(b, blocks_for(b))
    assert store.lookup(a).tiers == ("disk", "disk")
    assert_exact(store, a)
    assert store.lookup(a).tiers == ("host", "host")
    assert store.lookup(b).tiers == ("disk", "disk")
    store.check_integrity()
    store.close()


def test_a_get_larger_than_host_promotes_the_leading_blocks_that_fit_and_streams_the_rest(tmp_path: Path) -> None:
    # 10 disk blocks through a 2-block host tier: the first two are promoted, the other eight
    # are read from disk into the caller's memory and stay there; nothing the call promoted is
    # demoted by the same call, and a second get finds the same two in host and evicts nothing
    store = make_store(tmp_path, host_blocks=2, disk_blocks=16, write_policy="write_through")
    keys = chain(store, 10)
    store.put(keys, blocks_for(keys))
    store.close()
    store = make_store(tmp_path, host_blocks=2, disk_blocks=16)
    assert store.lookup(keys).tiers == ("disk",) * 10
    read = [store.stats()["disk"]["bytes_read"]]
    for round_ in range(2):
        assert_exact(store, keys)
        assert store.lookup(keys).tiers == ("host",) * 2 + ("disk",) * 8, f"get {round_ + 1}"
        stats = store.stats()
        assert stats["host"]["num_blocks"] == 2 and stats["host"]["evictions"] == 0
        assert stats["disk"]["num_blocks"] == 10
        read.append(stats["disk"]["bytes_read"])
        store.check_integrity()
    payload = SMALL_LAYOUT.bytes_per_block
    assert (read[1] - read[0], read[2] - read[1]) == (10 * payload, 8 * payload)  # then only the rest from disk
    store.close()


@pytest.mark.parametrize("host_blocks", [8, 2])  # every disk block promoted; or most read straight into dst
def test_a_key_twice_in_one_get_of_disk_blocks_fills_both_rows(tmp_path: Path, host_blocks: int) -> None:
    # Found by scripts/daemon_kill_loop.py: a get naming a disk block twice filled only the
    # row of its last occurrence (the rest stayed as the output tensor was), and promoted
    # the block into two host slots.
    store = make_store(tmp_path, host_blocks=host_blocks, disk_blocks=16, write_policy="write_through")
    keys = chain(store, 4)
    store.put(keys, blocks_for(keys))
    store.close()
    store = make_store(tmp_path, host_blocks=host_blocks, disk_blocks=16)
    assert store.lookup(keys).tiers == ("disk",) * 4
    twice = [keys[0], keys[1], keys[0], keys[2], keys[1]]
    assert torch.equal(store.get(twice, out=torch.full((5, *SMALL_LAYOUT.block_shape), 7.0)), blocks_for(twice))
    store.check_integrity()
    assert store.stats()["host"]["num_blocks"] == min(3, host_blocks)
    store.close()


@pytest.mark.parametrize("disk_codec", ["none", "int8"])
def test_a_promoting_get_copies_each_transfer_on_while_the_rest_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       disk_codec: str) -> None:
    # 96 blocks of 128 KiB (int8: 68 KiB slots) are several 4 MiB disk transfers: each block
    # promoted into host goes on to the caller's memory as its transfer lands, on the thread
    # that read it; the bytes are the bytes put (int8: within its bound), host holds them all
    import threading

    import kvstore.tiers.slab as slab_module
    from kvstore.store.levels.host_level import HostLevel

    layout = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, block_size=32, dtype=torch.float16)
    n, raw = 96, layout.bytes_per_block
    config = StoreConfig(layout=layout, model_id="promote", host_bytes=(n + 4) * raw, disk_path=tmp_path / "disk",
                         disk_bytes=(n + 4) * raw, write_policy="write_through", sync_disk=False, disk_codec=disk_codec)
    store = TieredStore(config)
    keys = store.block_keys(list(range(n * layout.block_size)))
    blocks = torch.randn((n, *layout.block_shape), generator=torch.Generator().manual_seed(5)).half()
    store.put(keys, blocks)
    store.close()
    copies: list[tuple[str, int]] = []
    read_rows = HostLevel.read_rows

    def spy(self: HostLevel, slots: list[int], dst: torch.Tensor) -> None:
        copies.append((threading.current_thread().name, len(slots)))
        read_rows(self, slots, dst)

    monkeypatch.setattr(HostLevel, "read_rows", spy)
    store = TieredStore(config)
    got = store.get(keys)
    if disk_codec == "none":
        assert torch.equal(got, blocks)
    else:
        err = (got.float() - blocks.float()).abs()
        assert bool((err <= blocks.float().abs().amax(dim=-1, keepdim=True) / 127).all())
    assert sum(count for _, count in copies) == n and len(copies) >= 3, copies  # per transfer, each block once
    if slab_module.READERS > 1:
        assert any(name.startswith("disk-tier-read") for name, _ in copies), copies
    assert store.lookup(keys).tiers == ("host",) * n
    assert torch.equal(store.get(keys), got)  # now from host: what the promoted slots hold
    store.check_integrity()
    store.close()


def test_promotion_never_keeps_blocks_on_disk(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=2, disk_blocks=8, promotion="never")
    a, b = chain(store, 2, salt=1), chain(store, 2, salt=2)
    store.put(a, blocks_for(a))
    store.put(b, blocks_for(b))
    assert_exact(store, a)
    assert store.lookup(a).tiers == ("disk", "disk")
    store.close()


def test_promotion_on_lookup_prefetches(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=2, disk_blocks=8, promotion="lookup")
    a, b = chain(store, 2, salt=1), chain(store, 2, salt=2)
    store.put(a, blocks_for(a))
    store.put(b, blocks_for(b))
    assert store.lookup(a).tiers == ("disk", "disk")  # the answer itself is a pure query
    store._executor.submit(lambda: None).result()  # the prefetch was queued before this
    store._executor.shutdown(wait=True)
    assert store.lookup(a).tiers == ("host", "host")
    store.check_integrity()


def test_write_through_puts_reach_disk_before_returning(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=8, disk_blocks=8, write_policy="write_through")
    keys = chain(store, 3)
    store.put(keys, blocks_for(keys))
    assert store.stats()["disk"]["num_blocks"] == 3
    disk = store.level("disk")
    assert {d.key for d in disk.tier.entries()} == set(keys)  # type: ignore[union-attr]
    store.check_integrity()
    store.close()


def test_seen_twice_admission(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=2, disk_blocks=8, disk_admission="seen_twice")
    once, twice = chain(store, 1, salt=1), chain(store, 1, salt=2)
    store.put(once, blocks_for(once))
    store.put(twice, blocks_for(twice))
    store.get(twice)  # second use
    filler = chain(store, 2, salt=3)
    store.put(filler, blocks_for(filler))
    assert store.lookup(once).num_blocks == 0  # dropped, never written to disk
    assert store.lookup(twice).tiers == ("disk",)
    # a block put again after being dropped counts as seen twice
    store.put(once, blocks_for(once))
    store.put(chain(store, 2, salt=4), blocks_for(chain(store, 2, salt=4)))
    assert store.lookup(once).tiers == ("disk",)
    store.check_integrity()
    store.close()


def test_close_writes_back_and_reopen_finds_everything(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=16)
    chains = [chain(store, 3, salt=s) for s in range(4)]
    for keys in chains:
        store.put(keys, blocks_for(keys))
    store.close()
    with pytest.raises(KVStoreError, match="closed"):
        store.lookup(chains[0])
    store.close()  # idempotent
    reopened = make_store(tmp_path, host_blocks=4, disk_blocks=16)
    for keys in chains:
        assert reopened.lookup(keys).tiers == ("disk",) * 3
        assert_exact(reopened, keys)
    reopened.check_integrity()
    reopened.close()


def test_close_with_small_disk_keeps_most_recent(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=8, disk_blocks=4)
    old, new = chain(store, 4, salt=1), chain(store, 4, salt=2)
    store.put(old, blocks_for(old))
    store.put(new, blocks_for(new))
    store.close()
    reopened = make_store(tmp_path, host_blocks=8, disk_blocks=4)
    assert reopened.lookup(new).num_blocks == 4
    assert reopened.lookup(old).num_blocks == 0
    reopened.close()


def test_fetch_into_tensor(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=2, disk_blocks=8)
    a, b = chain(store, 3, salt=1), chain(store, 1, salt=2)
    store.put(a, blocks_for(a))
    store.put(b, blocks_for(b))
    into = torch.full((3, *store.layout.block_shape), float("nan"))
    handle = store.fetch(a, into=into)
    result = handle.result(timeout=10)
    assert handle.done() and handle.wait(0)
    assert result.num_blocks == 3 and set(result.tiers) <= {"host", "disk"}
    assert torch.equal(into, blocks_for(a))
    # a partly missing chain delivers its leading run only
    missing = a[:1] + chain(store, 2, salt=9)
    into = torch.zeros((3, *store.layout.block_shape))
    assert store.fetch(missing, into=into).result(timeout=10).num_blocks == 1
    store.check_integrity()
    store.close()


def test_bad_tensors_are_rejected(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    keys = chain(store, 2)
    good = blocks_for(keys)
    with pytest.raises(LayoutMismatchError, match="dtype"):
        store.put(keys, good.half())
    with pytest.raises(LayoutMismatchError, match="shape"):
        store.put(keys, good[:, :1])
    with pytest.raises(LayoutMismatchError, match="got 1 blocks for 2 keys"):
        store.put(keys, good[:1])
    with pytest.raises(TypeError, match="32-byte"):
        store.put([b"short", keys[1]], good)
    with pytest.raises(ValueError, match="contiguous"):
        store.fetch(keys, into=torch.empty((2, *store.layout.block_shape[::-1])).permute(0, 5, 4, 3, 2, 1))
    assert len(store) == 0
    store.check_integrity()


def test_put_copies_what_is_not_plain_cpu_rows_and_keeps_no_autograd_history(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    a, b, c = chain(store, 2, salt=1), chain(store, 2, salt=2), chain(store, 2, salt=3)
    wanted = blocks_for(a)
    store.put(a, wanted.clone().requires_grad_(True))  # a tensor in an autograd graph
    got = store.get(a)
    assert torch.equal(got, wanted) and not got.requires_grad
    wide = torch.cat([blocks_for(b), torch.zeros_like(blocks_for(b))], dim=-1)
    store.put(b, wide[..., : store.layout.head_dim])  # a strided view of the right shape
    assert torch.equal(store.get(b), blocks_for(b))
    store.put(c, torch.nn.Parameter(blocks_for(c), requires_grad=False))  # a subclass: full checks
    assert torch.equal(store.get(c), blocks_for(c))
    store.check_integrity()


def test_a_key_twice_in_one_put_is_stored_once(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=8)
    keys = chain(store, 3)
    twice = [keys[0], keys[1], keys[0], keys[2]]
    store.put(twice, blocks_for(twice))
    assert len(store) == 3 and store.stats()["host"]["num_blocks"] == 3
    assert torch.equal(store.get(keys), blocks_for(keys))
    store.check_integrity()  # no slot leaked to the second copy


def test_a_host_write_that_fails_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Blocks are placed in host before their bytes are copied (Cascade.place): a write that
    # fails after that (a codec refusing what check_encodable let through, here injected)
    # must take them out again.
    store = make_store(tmp_path, host_blocks=8, host_codec="int8")
    held = chain(store, 2, salt=1)
    store.put(held, blocks_for(held))
    keys = chain(store, 3, salt=2)
    coding = store.level("host").coding  # type: ignore[union-attr]

    def refuse(payloads: object, dst: object) -> None:
        raise CodecError("injected: the codec refuses this block")

    monkeypatch.setattr(coding, "encode", refuse)
    with pytest.raises(KVStoreError, match="codec could not store 3 blocks"):
        store.put(keys, blocks_for(keys))
    assert store.lookup(keys).num_blocks == 0 and len(store) == 2
    assert store.stats()["host"]["num_blocks"] == 2
    store.check_integrity()
    monkeypatch.undo()
    store.put(keys, blocks_for(keys))  # the freed slots take the same blocks now
    assert store.lookup(keys).num_blocks == 3
    store.check_integrity()


def test_bad_configs_name_the_numbers(tmp_path: Path) -> None:
    small_layout = SMALL_LAYOUT
    with pytest.raises(ConfigError, match=r"host_bytes=100 is smaller than one block slot \(4096"):
        StoreConfig(layout=small_layout, host_bytes=100)
    with pytest.raises(ConfigError, match="disk_bytes=10"):
        StoreConfig(layout=small_layout, disk_path=tmp_path, disk_bytes=10)
    with pytest.raises(ConfigError, match="write_policy"):
        StoreConfig(layout=small_layout, write_policy="sometimes")
    with pytest.raises(ConfigError, match="needs a disk tier"):
        StoreConfig(layout=small_layout, write_policy="write_through")
    with pytest.raises(ConfigError, match="host_policy"):
        StoreConfig(layout=small_layout, host_policy="random")


def test_missing_or_unwritable_disk_path(tmp_path: Path) -> None:
    from kvstore import TierError

    with pytest.raises((TierError, OSError, ValueError), match="nope"):
        make_store(None, disk_path=tmp_path / "nope" / "deeper" / "x", disk_bytes=4 * SLOT)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises((TierError, OSError, ValueError), match="file"):
        make_store(None, disk_path=blocker, disk_bytes=4 * SLOT)


def test_tenants_never_share_blocks(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    a = chain(store, 2, tenant="acme")
    b = chain(store, 2, tenant="globex")
    store.put(a, blocks_for(a))
    assert store.lookup(b).num_blocks == 0
    assert set(a).isdisjoint(b)


def test_a_tenant_the_disk_catalog_cannot_record_is_refused_at_put(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=2, disk_blocks=8)
    for bad in ("é" * 128, "t" * 300, 7):  # 256 and 300 UTF-8 bytes, and not a str
        keys = chain(store, 2, salt=1)
        with pytest.raises(ValueError, match="tenant must be a str of at most 255 UTF-8 bytes"):
            store.put(keys, blocks_for(keys), tenant=bad)  # type: ignore[arg-type]
        slots = store.host_leases.reserve(1)
        with pytest.raises(ValueError, match="tenant must be a str"):
            store.host_leases.commit(keys[:1], slots, tenant=bad)  # type: ignore[arg-type]
        store.host_leases.cancel(slots)  # still reserved: nothing was published
    assert len(store) == 0
    longest = "é" * 127  # 254 bytes: the disk catalog records it
    keys = chain(store, 2, tenant=longest)
    store.put(keys, blocks_for(keys), tenant=longest)
    other = chain(store, 2, salt=2)
    store.put(other, blocks_for(other))  # demotes the first chain to disk
    assert store.lookup(keys).tiers == ("disk", "disk")
    assert store.view.block_info(keys[0])["tenant"] == longest  # type: ignore[index]
    store.check_integrity()
    store.close()


def test_a_disk_directory_of_another_namespace_is_refused_and_left_intact(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=2, disk_blocks=8, write_policy="write_through")
    keys = chain(store, 4)
    store.put(keys, blocks_for(keys))
    store.close()
    # the same bytes per block, so the slab's geometry alone cannot tell them apart
    other = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    assert other.bytes_per_block == SMALL_LAYOUT.bytes_per_block
    for overrides in ({"layout": other}, {"model_id": "another-model"}):
        with pytest.raises(TierError, match=r"holds 4 blocks of layout '\w+', not this store's \('\w+'\); "
                                            r"use another path or delete the directory"):
            make_store(tmp_path, host_blocks=2, disk_blocks=8, **overrides)  # type: ignore[arg-type]
    again = make_store(tmp_path, host_blocks=2, disk_blocks=8)  # the refused opens let the directory go
    assert again.lookup(keys).tiers == ("disk",) * 4
    assert_exact(again, keys)
    again.check_integrity()
    again.close()


def test_contains_and_delete(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=2, disk_blocks=8)
    a, b = chain(store, 2, salt=1), chain(store, 2, salt=2)
    store.put(a, blocks_for(a))
    store.put(b, blocks_for(b))  # a is on disk now
    assert store.contains([a[1], b[0], chain(store, 1, salt=3)[0]]) == [True, True, False]
    store.pin(b[:1])
    with pytest.raises(CapacityError, match="pinned or being read"):
        store.delete(b)
    assert store.contains(b) == [True, True]  # nothing deleted
    store.unpin(b[:1])
    assert store.delete(a[1:] + b + a[1:]) == 3
    assert store.contains(a + b) == [True, False, False, False]
    assert store.lookup(a).num_blocks == 1
    store.check_integrity()
    store.close()


def test_get_into_a_given_tensor(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    keys = chain(store, 2)
    store.put(keys, blocks_for(keys))
    out = torch.full((2, *store.layout.block_shape), float("nan"))
    assert store.get(keys, out=out) is out
    assert torch.equal(out, blocks_for(keys))
    with pytest.raises(LayoutMismatchError, match="got 1 blocks for 2 keys"):
        store.get(keys, out=out[:1])
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        store.get(keys, out=torch.empty((2, *store.layout.block_shape[::-1])).permute(0, 5, 4, 3, 2, 1))
    with pytest.raises(LayoutMismatchError, match="dtype"):
        store.get(keys, out=out.to(torch.float64))
    with pytest.raises(LayoutMismatchError, match=r"must be a torch\.Tensor"):
        store.get(keys, out=out.numpy())  # type: ignore[arg-type]
    # a tensor subclass takes the full checks, and is filled all the same
    param = torch.nn.Parameter(torch.zeros_like(out), requires_grad=False)
    assert store.get(keys, out=param) is param
    assert torch.equal(param, blocks_for(keys))


def _rss_mib() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


@pytest.mark.parametrize("shared", [False, True])
def test_a_closed_store_gives_its_host_ram_back_without_the_garbage_collector(shared: bool) -> None:
    """A store's objects refer to one another (a cycle): its host pool must not wait for the
    cyclic collector, or an engine opened and closed in a loop holds every pool it ever had."""
    gc.collect()
    gc.disable()
    try:
        before = _rss_mib()
        store = make_store(None, host_blocks=(256 << 20) // SLOT, shared_host=shared)
        keys = chain(store, 1)
        store.put(keys, blocks_for(keys))
        assert _rss_mib() - before >= 200  # MAP_POPULATE: the capacity is committed at open
        store.close()
        assert _rss_mib() - before < 64
    finally:
        gc.enable()
