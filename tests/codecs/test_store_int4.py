"""int4-rot as a store tier, for real: slots measured on the slab, gets equal to the codec's own
decode, exact=True, corrupt and unknown-version slots as counted misses, a codec change read by
the blocks' own headers, a host tier, and the command-line flags that name it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout, StoreConfig, TieredStore
from kvstore.codecs import get_codec
from kvstore.config import StoreSettings
from kvstore.errors import CodecError
from kvstore.services.common.store_args import add_store_arguments, store_settings_from_args
from kvstore.tiers.disk import DiskTier

from codec_testing import random_kv

# The benchmark's geometry: 24 layers, 2 KV heads, head dim 64, block 16, fp16 (192 KiB blocks).
LAYOUT = KVLayout(num_layers=24, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
RAW = LAYOUT.bytes_per_block
SLOT = 53248  # 52,256 encoded bytes rounded up to 4 KiB pages: 13 pages instead of 48
ROOT = Path(__file__).resolve().parents[2]


def _store(where: Path, host_blocks: int, disk_blocks: int = 0, **overrides: object) -> TieredStore:
    kwargs: dict[str, object] = {"layout": LAYOUT, "model_id": "int4-test", "host_bytes": host_blocks * RAW,
                                 "sync_disk": False}
    if disk_blocks:
        kwargs.update(disk_path=where / "disk", disk_bytes=disk_blocks * RAW)
    kwargs.update(overrides)
    return TieredStore(StoreConfig(**kwargs))  # type: ignore[arg-type]


def _keys(store: TieredStore, n: int, salt: int = 0) -> list[bytes]:
    return store.block_keys([salt * 10**6 + i for i in range(n * LAYOUT.block_size)])


def _decoded(name: str, blocks: torch.Tensor) -> torch.Tensor:
    codec = get_codec(name)
    return codec.decode(codec.encode(blocks), torch.empty_like(blocks))


def test_an_int4_disk_holds_3_7x_the_blocks_measured_on_the_slab(tmp_path: Path) -> None:
    assert -(-get_codec("int4-rot").encoded_bytes(LAYOUT) // 4096) * 4096 == SLOT
    store = _store(tmp_path, host_blocks=1, disk_blocks=20, disk_codec="int4-rot")
    keys = _keys(store, 80)
    blocks = random_kv(LAYOUT, 80, seed=1)
    store.put(keys, blocks)
    tier_slots = store.level("disk").num_slots  # type: ignore[union-attr]
    assert os.path.getsize(tmp_path / "disk" / "slab-000.bin") // tier_slots == SLOT
    assert tier_slots == 20 * RAW // SLOT == 73 and store.stats()["disk"]["num_blocks"] == 73  # raw: 20
    store.close()


def test_gets_return_the_codecs_decode_and_exact_refuses_them(tmp_path: Path) -> None:
    store = _store(tmp_path, host_blocks=2, disk_blocks=8, disk_codec="int4-rot")
    keys = _keys(store, 6)
    blocks = random_kv(LAYOUT, 6, seed=2)
    store.put(keys, blocks)  # tails first: the two heads stay on host, the rest is demoted
    match = store.lookup(keys)
    assert match.tiers == ("host",) * 2 + ("disk",) * 4 and match.lossy == (False,) * 2 + (True,) * 4
    assert store.lookup(keys, exact=True).num_blocks == 2
    assert store.view.codecs()["disk"] == {"codec": "int4-rot", "lossy": True, "version": 1, "scale_dtype": "float16",
                                      "group": 64, "rotated": True, "block_bytes": SLOT}
    with pytest.raises(KeyError, match="#2"):
        store.get(keys, exact=True)
    assert torch.equal(store.get(keys[:2], exact=True), blocks[:2]), "host blocks are the bytes put"
    got = store.get(keys[2:])
    assert torch.equal(got, _decoded("int4-rot", blocks[2:])), "the tier decodes as the codec does"
    rel = float((got.float() - blocks[2:].float()).norm() / blocks[2:].float().norm())
    assert 0.02 < rel < 0.12, rel
    assert store.fetch(keys, torch.empty_like(blocks), exact=True).result().num_blocks == 0
    store.check_integrity()
    store.close()


def test_nan_is_refused_at_put(tmp_path: Path) -> None:
    store = _store(tmp_path, host_blocks=2, disk_blocks=4, disk_codec="int4-rot")
    keys = _keys(store, 3)
    blocks = random_kv(LAYOUT, 3, seed=3)
    blocks[1, 5, 1, 2, 0, 7] = float("inf")
    with pytest.raises(CodecError, match=r"block 1 holds 0 NaN and 1 Inf values \(first at layer 5, V, token 2"):
        store.put(keys, blocks)
    assert len(store) == 0
    store.close()


def _slots(store: TieredStore, keys: list[bytes]) -> list[int]:
    return [store.view.block_info(k)["slots"]["disk"] for k in keys]  # type: ignore[index]


def test_a_corrupt_slot_and_an_unknown_version_are_counted_misses(tmp_path: Path) -> None:
    store = _store(tmp_path, host_blocks=1, disk_blocks=8, disk_codec="int4-rot", write_policy="write_through")
    keys = _keys(store, 4)
    blocks = random_kv(LAYOUT, 4, seed=4)
    store.put(keys, blocks)
    slots = _slots(store, keys)
    namespace_id = store.namespace.id
    store.close()
    with open(tmp_path / "disk" / "slab-000.bin", "r+b") as f:  # block 3: a flipped code byte
        f.seek(slots[3] * SLOT + 20000)
        byte = f.read(1)
        f.seek(slots[3] * SLOT + 20000)
        f.write(bytes([byte[0] ^ 0x10]))
    # Block 1: a header of version 2 under a valid checksum, as a newer writer would leave it.
    tier = DiskTier(tmp_path / "disk", 8 * RAW, SLOT, sync=False)
    entry = next(e for e in tier.entries() if e.key == keys[1])
    row = torch.empty(SLOT, dtype=torch.uint8)
    assert tier.read([entry.key], [entry.slot], [row]) == [True]
    row[5] = 2
    tier.write([entry.key], tier.allocate(1), [row], [entry.tenant], f"{namespace_id}/coded")
    tier.close()
    store = _store(tmp_path, host_blocks=1, disk_blocks=8, disk_codec="int4-rot", promotion="never")
    got = store.fetch(keys, torch.empty_like(blocks)).result()
    assert got.num_blocks == 1  # block 0; block 1 refused, and a prefix stops there
    stats = store.stats()["disk"]
    assert stats["refused"] == 1 and stats["errors"] >= 1  # block 1's version; block 3's checksum
    assert store.contains(keys) == [True, False, True, False]  # both deleted: misses from now on
    with pytest.raises(KeyError):
        store.get(keys[3:])
    assert torch.equal(store.get(keys[2:3]), _decoded("int4-rot", blocks[2:3]))
    store.check_integrity()
    store.close()


def test_a_switch_to_int4_norot_reads_the_old_blocks_by_their_header(tmp_path: Path) -> None:
    # Both int4 codecs take the same slot: one slab holds either, each block names its codec.
    assert get_codec("int4-norot").encoded_bytes(LAYOUT) == get_codec("int4-rot").encoded_bytes(LAYOUT)
    store = _store(tmp_path, host_blocks=1, disk_blocks=8, disk_codec="int4-rot", write_policy="write_through")
    keys = _keys(store, 3)
    blocks = random_kv(LAYOUT, 3, seed=5)
    store.put(keys, blocks)
    store.close()
    other = _store(tmp_path, host_blocks=1, disk_blocks=8, disk_codec="int4-norot", promotion="never")
    assert other.lookup(keys).num_blocks == 3
    assert torch.equal(other.get(keys), _decoded("int4-rot", blocks)), "old blocks must decode as int4-rot"
    more = _keys(other, 2, salt=1)
    other.put(more, random_kv(LAYOUT, 2, seed=6))
    assert other.stats()["disk"]["refused"] == 0
    other.close()
    slab = (tmp_path / "disk" / "slab-000.bin").read_bytes()
    ids = {slab[i * SLOT + 4] for i in range(len(slab) // SLOT) if slab[i * SLOT : i * SLOT + 4] == b"KVCB"}
    assert ids == {3, 4}, ids


def test_an_int4_host_tier_holds_3_6x_the_blocks(tmp_path: Path) -> None:
    store = _store(tmp_path, host_blocks=10, host_codec="int4-rot")
    assert store.level("host").num_slots == 10 * RAW // SLOT == 36  # type: ignore[union-attr]
    keys = _keys(store, 36)
    blocks = random_kv(LAYOUT, 36, seed=7)
    store.put(keys, blocks)
    match = store.lookup(keys)
    assert match.tiers == ("host",) * 36 and all(match.lossy)
    assert torch.equal(store.get(keys), _decoded("int4-rot", blocks))
    with pytest.raises(KeyError):
        store.get(keys, exact=True)
    store.check_integrity()
    store.close()


def test_the_store_flags_take_the_int4_codecs() -> None:
    parser = argparse.ArgumentParser()
    add_store_arguments(parser, defaults=StoreSettings())
    args = parser.parse_args(["--disk-codec", "int4-rot", "--host-codec", "int4-norot", "--disk-path", "/tmp/x"])
    settings = store_settings_from_args(args, StoreSettings())
    assert (settings.disk_codec, settings.host_codec) == ("int4-rot", "int4-norot")
    for command in ("serve", "engine"):  # the real commands' parsers: the flag, then --help exits 0
        ok = subprocess.run([sys.executable, "-m", "kvstore.cli", command, "--disk-codec", "int4-rot", "--help"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0 and "int4-rot" in ok.stdout, (command, ok.stderr[-2000:])
        bad = subprocess.run([sys.executable, "-m", "kvstore.cli", command, "--disk-codec", "int4", "--help"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and "invalid choice: 'int4'" in bad.stderr, (command, bad.stderr[-2000:])
