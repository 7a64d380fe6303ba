"""A store whose tiers hold int8/fp8-encoded blocks: sizes measured on the real slab, decoded
gets, exact=True, NaN refused at put, restarts, codec changes, and unknown versions."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout, StoreConfig, TieredStore
from kvstore.codecs import get_codec
from kvstore.errors import CodecError, ConfigError, KVStoreError
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.errors import TierError

from codec_testing import int8_bound, random_kv

# The benchmark's geometry: 24 layers, 2 KV heads, head dim 64, block 16, fp16 (192 KiB blocks).
LAYOUT = KVLayout(num_layers=24, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
RAW = LAYOUT.bytes_per_block


def _store(tmp_path: Path, host_blocks: int, disk_blocks: int = 0, **overrides: object) -> TieredStore:
    kwargs: dict[str, object] = {"layout": LAYOUT, "model_id": "codec-test", "host_bytes": host_blocks * RAW,
                                 "sync_disk": False}
    if disk_blocks:
        kwargs.update(disk_path=tmp_path / "disk", disk_bytes=disk_blocks * RAW)
    kwargs.update(overrides)
    return TieredStore(StoreConfig(**kwargs))  # type: ignore[arg-type]


def _keys(store: TieredStore, n: int, salt: int = 0) -> list[bytes]:
    return store.block_keys([salt * 10**6 + i for i in range(n * LAYOUT.block_size)])


def _slab(store: TieredStore) -> Path:
    return Path(store.config.settings.disk_path) / "slab-000.bin"  # type: ignore[arg-type]


def test_int8_disk_holds_twice_the_blocks_measured_on_the_slab(tmp_path: Path) -> None:
    raw_dir, int8_dir = tmp_path / "raw", tmp_path / "int8"
    raw_dir.mkdir()
    int8_dir.mkdir()
    sizes = {}
    for codec, where in (("none", raw_dir), ("int8", int8_dir)):
        store = _store(where, host_blocks=1, disk_blocks=20, disk_codec=codec)
        keys = _keys(store, 60)
        store.put(keys, random_kv(LAYOUT, 60, seed=1))
        num_on_disk = store.stats()["disk"]["num_blocks"]
        tier_slots = store.level("disk").num_slots  # type: ignore[union-attr]
        sizes[codec] = (os.path.getsize(_slab(store)) // tier_slots, num_on_disk)
        store.close()
    raw_slot, raw_blocks = sizes["none"]
    int8_slot, int8_blocks = sizes["int8"]
    assert raw_slot == RAW and raw_blocks == 20
    assert raw_slot / int8_slot == pytest.approx(1.92, abs=0.01), sizes  # 196608 / 102400
    assert int8_blocks == 38, sizes  # the same 20 raw slots' worth of disk holds 38 blocks


def test_get_from_a_lossy_disk_returns_decoded_values_and_exact_refuses_them(tmp_path: Path) -> None:
    store = _store(tmp_path, host_blocks=2, disk_blocks=8, disk_codec="int8")
    keys = _keys(store, 6)
    blocks = random_kv(LAYOUT, 6, seed=2)
    store.put(keys, blocks)  # tails first: the two heads stay on host, the rest is demoted
    match = store.lookup(keys)
    assert match.tiers == ("host",) * 2 + ("disk",) * 4
    assert match.lossy == (False,) * 2 + (True,) * 4
    assert store.lookup(keys, exact=True).num_blocks == 2
    info = store.view.block_info(keys[2])
    assert info is not None and info["codecs"] == {"disk": "int8"} and info["lossy"] and info["exact_tier"] is None
    assert store.stats()["disk"]["codec"] == "int8" and store.stats()["disk"]["lossy"] is True
    assert store.stats()["host"]["codec"] == "none" and store.stats()["host"]["lossy"] is False
    assert store.view.codecs()["disk"] == {"codec": "int8", "lossy": True, "version": 1, "scale_dtype": "float16",
                                      "block_bytes": 102400}
    with pytest.raises(KeyError, match="#2"):
        store.get(keys, exact=True)
    assert torch.equal(store.get(keys[:2], exact=True), blocks[:2]), "host blocks are the bytes put"
    got = store.get(keys[2:])  # promoted to host, decoded
    err = (got.float() - blocks[2:].float()).abs()
    assert bool((err <= int8_bound(blocks[2:], LAYOUT.dtype)).all()) and float(err.max()) > 0
    # Two were promoted to host (evicting the heads to disk): decoded values, still not exact.
    match = store.lookup(keys)
    assert match.tiers == ("disk",) * 2 + ("host",) * 2 + ("disk",) * 2 and all(match.lossy)
    with pytest.raises(KeyError):
        store.get(keys[2:3], exact=True)
    assert store.fetch(keys, torch.empty_like(blocks), exact=True).result().num_blocks == 0
    # Putting the bytes again makes the host copy exact.
    store.put(keys[2:3], blocks[2:3])
    assert torch.equal(store.get(keys[2:3], exact=True), blocks[2:3])
    store.check_integrity()
    store.close()


def test_nan_is_refused_at_put_when_a_tier_is_lossy(tmp_path: Path) -> None:
    store = _store(tmp_path, host_blocks=2, disk_blocks=4, disk_codec="fp8")
    keys = _keys(store, 3)
    blocks = random_kv(LAYOUT, 3, seed=3)
    blocks[1, 5, 1, 2, 0, 7] = float("nan")
    with pytest.raises(CodecError, match=r"block 1 holds 1 NaN and 0 Inf values \(first at layer 5, V, token 2"):
        store.put(keys, blocks)
    assert len(store) == 0
    store.close()
    raw = _store(tmp_path / "raw", host_blocks=3)  # no lossy tier: the bytes are stored as put
    raw.put(keys, blocks)
    assert torch.equal(raw.get(keys).view(torch.int16), blocks.view(torch.int16))
    raw.close()


def test_restart_with_an_int8_disk_finds_everything(tmp_path: Path) -> None:
    store = _store(tmp_path, host_blocks=2, disk_blocks=16, disk_codec="int8", write_policy="write_through")
    keys = _keys(store, 10)
    store.put(keys, random_kv(LAYOUT, 10, seed=4))
    before = store.get(keys)  # the 2 heads exact from host, 8 decoded from disk
    store.close()
    again = _store(tmp_path, host_blocks=2, disk_blocks=16, disk_codec="int8")
    assert again.lookup(keys).tiers == ("disk",) * 10
    after = again.get(keys)
    assert torch.equal(after[2:], before[2:])  # the same decoded values
    assert bool(((after[:2].float() - before[:2].float()).abs() <= int8_bound(before[:2], LAYOUT.dtype)).all())
    assert again.stats()["disk"]["refused"] == 0
    again.check_integrity()
    again.close()


def test_a_changed_codec_reads_old_blocks_by_their_header(tmp_path: Path) -> None:
    # int8 and fp8 blocks of this layout both take 25 pages: one slab holds either, and each
    # block's header says how to read it.
    store = _store(tmp_path, host_blocks=2, disk_blocks=16, disk_codec="int8", write_policy="write_through")
    keys = _keys(store, 6)
    store.put(keys, random_kv(LAYOUT, 6, seed=5))
    store.close()
    store = _store(tmp_path, host_blocks=2, disk_blocks=16, disk_codec="int8", promotion="never")
    as_int8 = store.get(keys)
    store.close()
    fp8 = _store(tmp_path, host_blocks=2, disk_blocks=16, disk_codec="fp8", promotion="never")
    assert fp8.lookup(keys).num_blocks == 6
    assert torch.equal(fp8.get(keys), as_int8), "old int8 blocks must decode as int8"
    more = _keys(fp8, 3, salt=1)
    new = random_kv(LAYOUT, 3, seed=6)
    fp8.put(more, new)
    fp8.close()
    slab = (tmp_path / "disk" / "slab-000.bin").read_bytes()
    codec_ids = {slab[i * 102400 + 4] for i in range(len(slab) // 102400) if slab[i * 102400 : i * 102400 + 4] == b"KVCB"}
    assert codec_ids == {1, 2}, codec_ids  # both codecs' blocks in one slab
    assert get_codec("fp8").encoded_bytes(LAYOUT) <= 102400 < get_codec("int8").encoded_bytes(LAYOUT) + 4096


def test_a_codec_change_that_changes_the_slot_size_makes_misses_not_wrong_kv(tmp_path: Path) -> None:
    store = _store(tmp_path, host_blocks=2, disk_blocks=8, disk_codec="int8", write_policy="write_through")
    keys = _keys(store, 4)
    blocks = random_kv(LAYOUT, 4, seed=7)
    store.put(keys, blocks)
    store.close()
    raw = _store(tmp_path, host_blocks=2, disk_blocks=8)  # none: 48-page slots instead of 25
    assert raw.lookup(keys).num_blocks == 0 and len(raw) == 0
    assert raw.level("disk").tier.num_dropped_on_open == 4  # type: ignore[union-attr]
    raw.put(keys, blocks)
    raw.close()
    back = _store(tmp_path, host_blocks=2, disk_blocks=8, disk_codec="int8")
    assert back.lookup(keys).num_blocks == 0  # reformatted again: misses
    back.close()
    # Another layout's directory is still refused, not reformatted.
    other = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
    with pytest.raises(TierError, match="payload_bytes"):
        TieredStore(StoreConfig(layout=other, model_id="codec-test", host_bytes=1 << 20,
                                disk_path=tmp_path / "disk", disk_bytes=1 << 22))


def test_raw_and_encoded_blocks_of_one_slot_size_never_meet(tmp_path: Path) -> None:
    # head dim 3: raw 12288 bytes, int8 10272 bytes rounded up to 12288 too. The catalog's
    # layout id tells the two representations apart.
    layout = KVLayout(num_layers=4, num_kv_heads=16, head_dim=3, block_size=16, dtype=torch.float16)
    assert layout.bytes_per_block == 12288 and get_codec("int8").encoded_bytes(layout) == 10272

    def open_store(codec: str) -> TieredStore:
        return TieredStore(StoreConfig(layout=layout, model_id="m", host_bytes=12288, disk_path=tmp_path / "d",
                                       disk_bytes=8 * 12288, disk_codec=codec, sync_disk=False,
                                       write_policy="write_through"))

    raw = open_store("none")
    keys = raw.block_keys(list(range(3 * 16)))
    raw.put(keys, random_kv(layout, 3, seed=8))
    raw.close()
    coded = open_store("int8")
    assert coded.lookup(keys).num_blocks == 0 and coded.stats()["disk"]["refused"] == 3
    coded.put(keys, random_kv(layout, 3, seed=9))
    coded.close()
    raw = open_store("none")
    assert raw.lookup(keys).num_blocks == 0 and raw.stats()["disk"]["refused"] == 3
    raw.close()


def test_an_unknown_format_version_is_a_counted_miss(tmp_path: Path) -> None:
    store = _store(tmp_path, host_blocks=1, disk_blocks=8, disk_codec="int8", write_policy="write_through")
    keys = _keys(store, 3)
    store.put(keys, random_kv(LAYOUT, 3, seed=10))
    namespace_id = store.namespace.id
    store.close()
    # Rewrite block 1 with a header of version 2 under a valid checksum, as a newer writer would.
    tier = DiskTier(tmp_path / "disk", 8 * RAW, 102400, sync=False)
    entry = next(e for e in tier.entries() if e.key == keys[1])
    row = torch.empty(102400, dtype=torch.uint8)
    assert tier.read([entry.key], [entry.slot], [row]) == [True]
    row[5] = 2
    slot = tier.allocate(1)
    tier.write([entry.key], slot, [row], [entry.tenant], f"{namespace_id}/coded")
    tier.close()
    store = _store(tmp_path, host_blocks=1, disk_blocks=8, disk_codec="int8")
    assert store.lookup(keys).num_blocks == 3  # the catalog names it; only reading shows the version
    assert store.fetch(keys, torch.empty((3, *LAYOUT.block_shape), dtype=LAYOUT.dtype)).result().num_blocks == 1
    stats = store.stats()["disk"]
    assert stats["refused"] == 1
    assert store.lookup(keys).num_blocks == 1 and store.contains(keys) == [True, False, True]
    store.check_integrity()
    store.close()


def test_an_int8_host_tier_holds_twice_the_blocks_and_hands_out_no_leases(tmp_path: Path) -> None:
    raw = _store(tmp_path, host_blocks=10)
    coded = _store(tmp_path, host_blocks=10, host_codec="int8")
    assert coded.level("host").num_slots == 19 and raw.level("host").num_slots == 10  # type: ignore[union-attr]
    keys = _keys(coded, 19)
    blocks = random_kv(LAYOUT, 19, seed=11)
    coded.put(keys, blocks)
    assert coded.lookup(keys).tiers == ("host",) * 19 and all(coded.lookup(keys).lossy)
    got = coded.get(keys)
    assert bool(((got.float() - blocks.float()).abs() <= int8_bound(blocks, LAYOUT.dtype)).all())
    with pytest.raises(KeyError):
        coded.get(keys, exact=True)
    with pytest.raises(KVStoreError, match="leases hand out raw slots"):
        coded.host_leases.acquire(keys[:1])
    coded.check_integrity()
    coded.close()
    raw.close()
    with pytest.raises(ConfigError, match="shared_host needs host_codec='none'"):
        StoreConfig(layout=LAYOUT, host_bytes=10 * RAW, host_codec="int8", shared_host=True)
    with pytest.raises(ConfigError, match="would store decoded values"):
        StoreConfig(layout=LAYOUT, host_bytes=10 * RAW, host_codec="int8", disk_path=tmp_path, disk_bytes=RAW)
    with pytest.raises(ConfigError, match=r"disk_codec must be one of \['none', 'int8', 'int8-fp32', 'fp8', 'int4-rot', 'int4-norot', 'auto'\]"):
        StoreConfig(layout=LAYOUT, disk_codec="zstd")


def test_int8_host_over_int8_disk_round_trips_through_both(tmp_path: Path) -> None:
    store = _store(tmp_path, host_blocks=2, disk_blocks=8, host_codec="int8", disk_codec="int8")
    keys = _keys(store, 8)
    blocks = random_kv(LAYOUT, 8, seed=12)
    store.put(keys, blocks)  # 3 fit the int8 host; the rest were demoted, re-encoded
    assert store.lookup(keys).count("disk") == 5
    got = store.get(keys)
    # int8 of int8-decoded values: each round adds at most the bound once more.
    assert bool(((got.float() - blocks.float()).abs() <= 2 * int8_bound(blocks, LAYOUT.dtype)).all())
    store.check_integrity()
    store.close()


def test_another_namespaces_directory_is_never_reformatted(tmp_path: Path) -> None:
    # A raw directory of another model whose payload size equals this layout's int8 slot size.
    other = KVLayout(num_layers=25, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float16)
    assert other.bytes_per_block == 102400 == -(-get_codec("int8").encoded_bytes(LAYOUT) // 4096) * 4096
    theirs = TieredStore(StoreConfig(layout=other, model_id="theirs", host_bytes=other.bytes_per_block,
                                     disk_path=tmp_path / "disk", disk_bytes=4 * other.bytes_per_block,
                                     write_policy="write_through", sync_disk=False))
    keys = theirs.block_keys(list(range(32)))
    theirs.put(keys, random_kv(other, 2, seed=13))
    theirs.close()
    with pytest.raises(TierError, match="blocks of layout"):
        _store(tmp_path, host_blocks=1, disk_blocks=4)  # raw 196608-byte payload: would reformat
    again = TieredStore(StoreConfig(layout=other, model_id="theirs", host_bytes=other.bytes_per_block,
                                    disk_path=tmp_path / "disk", disk_bytes=4 * other.bytes_per_block))
    assert again.lookup(keys).num_blocks == 2  # untouched
    again.close()


def test_a_long_prefix_decodes_transfer_by_transfer_on_the_reader_threads(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # 100 int8 blocks of 100 KiB slots: three 4 MiB transfers, each decoded by the thread that
    # read it as soon as it verifies, one of them corrupt: its blocks are misses, the rest exact.
    import kvstore.tiers.slab as slab_module
    from kvstore.store.levels.coding import LevelCodec

    store = _store(tmp_path, host_blocks=102, disk_blocks=102, disk_codec="int8", write_policy="write_through",
                   promotion="never")
    keys = _keys(store, 100)
    blocks = random_kv(LAYOUT, 100, seed=14)
    store.put(keys, blocks)
    store.close()
    calls: list[tuple[str, int]] = []
    decode = LevelCodec.decode

    def spy(self: LevelCodec, src: list[torch.Tensor], outs: list[torch.Tensor]) -> list[bool]:
        calls.append((threading.current_thread().name, len(src)))
        return decode(self, src, outs)

    monkeypatch.setattr(LevelCodec, "decode", spy)
    store = _store(tmp_path, host_blocks=102, disk_blocks=102, disk_codec="int8", promotion="never")
    whole = store.get(keys)
    assert sum(n for _, n in calls) == 100 and len(calls) >= 3, calls
    if slab_module.READERS > 1:
        assert any(name.startswith("disk-tier-read") for name, _ in calls), calls
    one_by_one = torch.cat([store.get([k]) for k in keys[::-1]]).flip(0)
    assert torch.equal(whole, one_by_one)
    assert bool(((whole.float() - blocks.float()).abs() <= int8_bound(blocks, LAYOUT.dtype)).all())
    slot = store.view.block_info(keys[50])["slots"]["disk"]  # type: ignore[index]
    slot_bytes = store.config.tier_slot_bytes("disk")
    store.close()
    with open(_slab(store), "r+b") as f:  # block 50, in the second transfer: a flipped code byte
        f.seek(slot * slot_bytes + 5000)
        byte = f.read(1)
        f.seek(slot * slot_bytes + 5000)
        f.write(bytes([byte[0] ^ 0x10]))
    store = _store(tmp_path, host_blocks=102, disk_blocks=102, disk_codec="int8", promotion="never")
    into = torch.zeros_like(blocks)
    assert store.fetch(keys, into).result().num_blocks == 50
    assert torch.equal(into[:50], whole[:50])
    assert store.contains(keys)[49:52] == [True, False, True]  # deleted: a miss from now on
    assert store.stats()["disk"]["errors"] >= 1
    store.check_integrity()
    store.close()


def test_a_commit_replaces_a_decoded_host_copy_with_the_bytes_written(tmp_path: Path) -> None:
    # As a put does: a host copy decoded from the int8 disk is not the bytes put, so the
    # exact bytes committed into reserved slots take its place (the old copy's slot is freed).
    store = _store(tmp_path, host_blocks=4, disk_blocks=16, disk_codec="int8", write_policy="write_through")
    keys = _keys(store, 2)
    blocks = random_kv(LAYOUT, 2, seed=9)
    store.put(keys, blocks)
    store.close()
    store = _store(tmp_path, host_blocks=4, disk_blocks=16, disk_codec="int8")
    store.get(keys)  # promoted: host now holds the decoded copies
    assert store.lookup(keys).tiers == ("host", "host") and store.lookup(keys).lossy == (True, True)
    slots = store.host_leases.reserve(2)
    for slot, row in zip(slots, blocks.view(torch.uint8).reshape(2, RAW), strict=True):
        store.level("host").tier.pool[slot, :RAW].copy_(row)  # type: ignore[union-attr]
    store.host_leases.commit(keys, slots)
    assert store.lookup(keys, exact=True).tiers == ("host", "host")
    assert torch.equal(store.get(keys, exact=True).view(torch.int16), blocks.view(torch.int16))
    assert store.stats()["host"]["num_blocks"] == 2
    store.check_integrity()
    store.close()


def test_reads_larger_than_the_warm_staging_reuse_it_read_after_read(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An int8 disk reads through staging rows kept warm between reads. Two reads in a row
    larger than the buffer made at open: the second takes the larger buffer the first one left
    behind (picking it out of the pool once raised RuntimeError: tensors compared with ==)."""
    import kvstore.store.levels.staging as staging_module

    monkeypatch.setattr(staging_module, "WARM_BYTES", 2 * 100 << 10)  # room for two encoded blocks
    store = _store(tmp_path, host_blocks=1, disk_blocks=16, disk_codec="int8", promotion="never")
    keys = _keys(store, 6)
    blocks = random_kv(LAYOUT, 6, seed=8)
    store.put(keys, blocks)
    assert store.lookup(keys).tiers == ("host",) + ("disk",) * 5
    for _ in range(3):
        got = store.get(keys)  # five disk blocks each time: more than the warm buffer holds
        assert bool(((got.float() - blocks.float()).abs() <= int8_bound(blocks, LAYOUT.dtype)).all())
    store.check_integrity()
    store.close()
