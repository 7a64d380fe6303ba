"""Upgrade: a disk tier written by the release before KV groups (commit add261d) still serves
every block it holds, under the same keys, to today's store (tests/store/data says how it was
written). A layout of one full-attention group keeps its fingerprint, keys and bytes."""

from __future__ import annotations

import tarfile
from pathlib import Path

import torch

from kvstore import KVLayout, StoreConfig, TieredStore

from factories import SLOT, SMALL_LAYOUT, blocks_for

DATA = Path(__file__).parent / "data" / "store_before_groups.tar.gz"

# The keys the old release printed for tokens 0..23 (six blocks of four), without and with a tenant.
OLD_KEYS = {
    "": [
        "0097b606fa3e9404c33810c80733a8536bb3778e4fd56e38592cff7f45aff298",
        "0d964c7d9d0c55c9a6b08a94225c35f80e6122e8fcd211fc7ae1faa135614ae5",
        "702a4c7e0fd5fca3afcd0d9b2c46fb7d497f01361f213fcd65c5f55232e49a0c",
        "caca831842e25efe5362b51320530e52f31e88ca2ab0fe315d3003e1b0e31962",
        "ce89718e63c3ea8823774fe97b676c79cbeca3386fde1b928347c86ec9a9649e",
        "ef9c52ea7d19e67532324c20247d3890b4fe0761e7ab7d5e52b3da1ca32b1726",
    ],
    "acme": [
        "dcba801224905bc5ab1d8e0dd1904c8ee6ddfeae610b352e25ce07a7b2f494cc",
        "0610c2738e09b90e4e5bb3153bfd7527cc920718b8630dbf0ed31547dfd1e7e0",
        "911cc3724cafa484f43e9c217c2b51b621bd92c08e2dbdcdc526208b55790f46",
        "c1adb5baf6bdd0fbf03436d11013d77779ab0dce41d91b714922116feab96bf1",
        "fc0137b5d6b4b34437b16ab2ae20441bd9d47c8231b798f4d229fd8f171e5d44",
        "4bbf69c6bad360ca7e737053113e1057eb480749efec7946a25f391d6aacf056",
    ],
}


def _open_old_store(tmp_path: Path, layout: KVLayout = SMALL_LAYOUT) -> TieredStore:
    with tarfile.open(DATA) as archive:
        archive.extractall(tmp_path, filter="data")
    return TieredStore(StoreConfig(layout=layout, model_id="upgrade-model", host_bytes=8 * SLOT,
                                   disk_path=tmp_path / "disk", disk_bytes=16 * SLOT))


def test_a_store_written_before_groups_serves_its_blocks(tmp_path: Path) -> None:
    store = _open_old_store(tmp_path)
    try:
        assert not store.layout.is_hybrid and store.layout.num_groups == 1
        tokens = list(range(6 * 4))
        for tenant, old in OLD_KEYS.items():
            keys = store.block_keys(tokens, tenant=tenant)
            assert [k.hex() for k in keys] == old, f"tenant {tenant!r}: today's keys differ from the old release's"
            assert store.group_keys(keys, 0) == keys, "group 0 of a one-group layout renamed its keys"
            match = store.lookup(keys)
            assert (match.num_blocks, set(match.tiers)) == (6, {"disk"})
            assert torch.equal(store.get(keys), blocks_for(keys)), f"tenant {tenant!r}: bytes changed"
        store.check_integrity()
    finally:
        store.close()
