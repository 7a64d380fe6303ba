"""TieredStore's cache management: pins as leases (TTL, holders), prefetch, inspect, delete
with descendants, forget a tenant (pinned blocks, blocks being read, disk, a restart), and
bad input refused before anything changes."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

from kvstore import CapacityError
from kvstore.api import MAX_KEYS, MAX_PIN_TTL_S

from factories import blocks_for, chain, make_store
from waiting import wait_blocked, wait_until

# ------------------------------------------------------------------------------ pins


def test_a_pin_with_a_ttl_ends_by_itself_and_then_its_block_can_be_evicted(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4)
    held = chain(store, 2, salt=1)
    store.put(held, blocks_for(held))
    store.pin(held, ttl_s=0.3)
    info = store.inspect(held)[0]
    assert info is not None and info.pins == 1 and 0 < info.pin_expires_s <= 0.3  # type: ignore[operator]
    others = chain(store, 8, salt=2)
    store.put(others, blocks_for(others))  # host is full of others but for the pinned two
    assert store.contains(held) == [True, True]
    wait_until(lambda: store.inspect(held[:1])[0].pins == 0, 10, "the pin's TTL")  # type: ignore[union-attr]
    store.put(chain(store, 4, salt=3), blocks_for(chain(store, 4, salt=3)))
    assert store.contains(held) == [False, False]  # unpinned by its deadline, then evicted
    store.check_integrity()
    store.close()


def test_unpin_undoes_the_most_recent_pin_and_a_holder_only_its_own(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=8)
    keys = chain(store, 2)
    store.put(keys, blocks_for(keys))
    store.pin(keys)  # no deadline
    store.pin(keys[:1], ttl_s=600)
    store.pin(keys[:1], holder=7)
    info = store.inspect(keys[:1])[0]
    assert info is not None and info.pins == 3 and info.pin_expires_s is None  # one pin has no deadline
    with pytest.raises(ValueError, match="not pinned by this connection"):
        store.unpin(keys[1:], holder=7)
    store.unpin(keys[:1], holder=7)
    assert store.end_pins(7) == 0
    store.unpin(keys[:1])  # the newest: the TTL one
    assert store.inspect(keys[:1])[0].pin_expires_s is None  # type: ignore[union-attr]
    store.pin(keys, holder=9)
    assert store.end_pins(9) == 2  # a closed connection's pins end at once
    store.unpin(keys)
    with pytest.raises(ValueError, match="is not pinned"):
        store.unpin(keys[:1])
    assert [i.pins for i in store.inspect(keys)] == [0, 0]  # type: ignore[union-attr]
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("ttl", [0, -1, 0.0, MAX_PIN_TTL_S + 1, math.inf, math.nan, True, "10"])
def test_a_bad_ttl_is_refused_and_pins_nothing(tmp_path: Path, ttl: object) -> None:
    store = make_store(tmp_path, host_blocks=4)
    keys = chain(store, 1)
    store.put(keys, blocks_for(keys))
    with pytest.raises(ValueError, match="ttl_s must be a number of seconds > 0 and at most 86400"):
        store.pin(keys, ttl_s=ttl)  # type: ignore[arg-type]
    assert store.inspect(keys)[0].pins == 0  # type: ignore[union-attr]
    store.close()


def test_pinning_a_block_not_held_pins_nothing(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4)
    keys = chain(store, 2)
    store.put(keys[:1], blocks_for(keys[:1]))
    with pytest.raises(KeyError, match=keys[1].hex()):
        store.pin(keys, ttl_s=5)
    assert store.inspect(keys[:1])[0].pins == 0  # type: ignore[union-attr]
    store.close()


# ------------------------------------------------------------------------------ prefetch


def test_prefetch_returns_at_once_and_brings_disk_blocks_up_to_host(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=16)
    cold = chain(store, 4, salt=1)
    store.put(cold, blocks_for(cold))
    store.put(chain(store, 4, salt=2), blocks_for(chain(store, 4, salt=2)))  # cold goes down to disk
    assert store.lookup(cold).tiers == ("disk",) * 4
    handle = store.prefetch(cold)
    assert handle.num_requested == 4
    assert handle.result(10) == 4 and handle.done()
    assert store.lookup(cold).tiers == ("host",) * 4
    assert torch.equal(store.get(cold), blocks_for(cold))
    missing = chain(store, 2, salt=9)
    assert store.prefetch(missing).result(10) == 0
    store.check_integrity()
    store.close()


def test_a_prefetch_of_ten_million_keys_is_refused_before_any_work(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=8)
    cold = chain(store, 4, salt=1)
    store.put(cold, blocks_for(cold))
    store.put(chain(store, 4, salt=2), blocks_for(chain(store, 4, salt=2)))
    before = store.stats()
    with pytest.raises(ValueError, match=f"at most {MAX_KEYS} keys, got 10000000"):
        store.prefetch(cold * 2_500_000)
    with pytest.raises(ValueError, match=f"at most {MAX_KEYS} keys"):
        store.inspect(cold * 20_000)
    assert store.lookup(cold).tiers == ("disk",) * 4  # nothing moved
    assert store.stats()["disk"]["bytes_read"] == before["disk"]["bytes_read"]
    store.close()


# ------------------------------------------------------------------------------ inspect


def test_inspect_names_every_tier_its_codec_and_size(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, disk_blocks=8, write_policy="write_through", disk_codec="int8")
    keys = chain(store, 3, tenant="acme")
    store.put(keys, blocks_for(keys), tenant="acme")
    store.pin(keys[:1], ttl_s=60)
    info = store.inspect([*keys, chain(store, 1, salt=5)[0]])
    assert info[3] is None
    first = info[0]
    assert first is not None and first.key == keys[0] and first.tiers == ("host", "disk")
    assert first.codecs == {"host": "none", "disk": "int8"} and first.tenant == "acme"
    codecs = store.view.codecs()
    assert first.stored_bytes == {t: codecs[t]["block_bytes"] for t in ("host", "disk")}
    assert first.stored_bytes == {"host": 512, "disk": 4096}  # a coded disk slot is padded to 4 KiB
    assert first.pins == 1 and first.pin_expires_s is not None and 59 < first.pin_expires_s <= 60
    assert info[1] is not None and info[1].pins == 0 and info[1].pin_expires_s is None
    assert first.as_dict()["key"] == keys[0].hex()
    store.close()


# ------------------------------------------------------------------------------ delete


def test_delete_with_descendants_takes_the_subtree_and_nothing_else(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=16)
    bs = store.layout.block_size
    trunk = [7] * (2 * bs)
    a = store.block_keys([*trunk, *range(100, 100 + 2 * bs)])  # trunk (2 blocks) + branch a (2)
    b = store.block_keys([*trunk, *range(200, 200 + 3 * bs)])  # trunk + branch b (3)
    other = chain(store, 2, salt=3)
    for keys in (a, b, other):
        store.put(keys, blocks_for(keys))
    assert a[:2] == b[:2]
    assert store.delete(a[2:3]) == 1  # one block: the one after it stays, unreachable from the root
    assert store.contains(a[3:]) == [True] and store.lookup(a).num_blocks == 2
    assert store.delete(a[1:2], descendants=True) == 1 + 3  # a[1] (= b[1]) and b[2:]
    assert store.contains(a) == [True, False, False, True]  # a[3]: its parent was gone already
    assert store.contains(b) == [True] + [False] * 4
    assert store.lookup(a).num_blocks == 1
    assert store.contains(other) == [True, True]
    store.pin(other[1:])
    with pytest.raises(CapacityError, match="1 of 2 blocks are pinned"):
        store.delete(other[:1], descendants=True)
    assert store.contains(other) == [True, True]  # all or nothing
    store.check_integrity()
    store.close()


# ------------------------------------------------------------------------------ forget


def test_forget_takes_every_block_of_a_tenant_pinned_on_disk_and_across_a_restart(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=6, disk_blocks=32)
    acme = [chain(store, 5, salt=s, tenant="acme") for s in range(3)]
    beta = chain(store, 5, salt=0, tenant="beta")
    for keys in acme:
        store.put(keys, blocks_for(keys), tenant="acme")
    store.put(beta, blocks_for(beta), tenant="beta")
    store.pin(acme[2][:2])
    store.pin(acme[2][:1], ttl_s=60, holder=3)
    held = [k for keys in acme for k in keys]
    tiers = {t for i in store.inspect(held) if i is not None for t in i.tiers}
    assert tiers == {"host", "disk"}
    report = store.forget_tenant("acme")
    assert report.complete and report.num_blocks == 15 and report.pins_released == 3
    assert report.deleted["host"] + report.deleted["disk"] >= 15 and report.deleted["disk"] > 0
    assert store.contains(held) == [False] * 15
    assert store.end_pins(3) == 0  # its lease went with the blocks
    assert torch.equal(store.get(beta), blocks_for(beta))
    assert store.forget_tenant("acme").num_blocks == 0  # nothing left: a second forget is harmless
    store.check_integrity()
    store.close()
    again = make_store(tmp_path, host_blocks=6, disk_blocks=32)  # the catalog does not bring them back
    assert again.contains(held) == [False] * 15
    assert again.lookup(beta).num_blocks == 5 and torch.equal(again.get(beta), blocks_for(beta))
    again.close()


def test_forget_waits_for_a_reader_which_keeps_the_bytes_it_started_with(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=8)
    keys = chain(store, 3, tenant="acme")
    store.put(keys, blocks_for(keys), tenant="acme")
    slots = store.host_leases.acquire(keys)  # a read lease: the daemon's shared-memory readers hold blocks so
    assert len(slots) == 3
    done = threading.Event()
    result: list[object] = []
    forgetting = threading.Thread(target=lambda: (result.append(store.forget_tenant("acme")), done.set()),
                                  daemon=True)
    forgetting.start()
    wait_blocked(forgetting, "_local", what="the forget, polling its tenant's blocks")
    assert not done.is_set()  # the blocks are being read: the forget waits for their reader
    assert store.contains(keys) == [True] * 3
    store.host_leases.release(keys)
    assert done.wait(10)
    assert store.contains(keys) == [False] * 3 and store.lookup(keys).num_blocks == 0
    store.check_integrity()
    store.close()


def test_forget_gives_up_after_its_wait_naming_the_blocks_still_read(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=8)
    keys = chain(store, 2, tenant="acme")
    store.put(keys, blocks_for(keys), tenant="acme")
    store.host_leases.acquire(keys[:1])
    with pytest.raises(CapacityError, match=r"tenant 'acme': 1 of its blocks are still being read after 0.2 s"):
        store.forget_tenant("acme", wait_s=0.2)
    assert store.contains(keys) == [True, False]  # the other one went; forgetting again finishes it
    store.host_leases.release(keys[:1])
    assert store.forget_tenant("acme").num_blocks == 1
    store.close()


@pytest.mark.parametrize("tenant", [None, 7, "x" * 300])
def test_forget_of_a_bad_tenant_name_is_refused(tmp_path: Path, tenant: object) -> None:
    store = make_store(tmp_path, host_blocks=4)
    keys = chain(store, 1)
    store.put(keys, blocks_for(keys))
    with pytest.raises(ValueError, match="tenant must be a str of at most 255 UTF-8 bytes"):
        store.forget_tenant(tenant)  # type: ignore[arg-type]
    assert store.contains(keys) == [True]
    store.close()
