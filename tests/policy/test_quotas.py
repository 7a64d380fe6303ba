"""Quotas per tenant and tier in a real TieredStore (real host pool, real LMDB disk tier):
the soft quota's victim order, the hard quota's cap under concurrent puts, usage counters
against the block index, and bad quotas refused with nothing lost."""

from __future__ import annotations

import contextlib
import random
import threading
from pathlib import Path

import pytest
import torch

from kvstore.errors import CapacityError, ConfigError
from kvstore.policy.eviction import LRUPolicy
from kvstore.policy.quotas import Limit, QuotaTable, TierQuota
from kvstore.policy.tenant_policy import TenantPolicy

from factories import SLOT, blocks_for, chain, make_store, run_in_threads


def table(**rows: dict[str, TierQuota]) -> QuotaTable:
    return QuotaTable(rows)


def soft(share: float) -> TierQuota:
    return TierQuota(soft=Limit(share=share))


# ----------------------------------------------------------------------------- the victim order


def test_soft_quota_victim_order_most_over_first_then_its_own_lru_order() -> None:
    owners = {f"{t}{i}": t for t in "abc" for i in range(10)}
    policy = TenantPolicy(LRUPolicy, owners.__getitem__)
    for i in range(10):  # interleaved: one shared LRU order would alternate tenants
        for t in "abc":
            if t != "c" or i < 2:
                policy.insert([f"{t}{i}"], [None])
    policy.set_limits({"a": 4, "b": 8, "c": 4})  # a: 10/4, b: 10/8, c: 2/4
    order = [policy.pop_victim() for _ in range(10)]
    # a is the most over (2.5x) until it is at 5/4 = b's 10/8: ties go to the larger (b), then
    # each stays the fullest in turn; within a tenant its own LRU order
    assert order == ["a0", "a1", "a2", "a3", "a4", "b0", "a5", "b1", "b2", "a6"]
    assert policy.counts == {"a": 3, "b": 7, "c": 2}
    # every tenant under its soft quota now: the fullest relative to it still goes first
    policy.set_limits({"a": 10, "b": 10, "c": 10})
    assert policy.pop_victim() == "b3"
    policy.check_integrity()


def test_no_quota_keeps_one_shared_order_and_a_mode_switch_keeps_the_blocks() -> None:
    owners = {f"{t}{i}": t for t in "ab" for i in range(6)}
    plain, wrapped = LRUPolicy(), TenantPolicy(LRUPolicy, owners.__getitem__)
    for i in range(6):
        for t in "ab":
            plain.insert([f"{t}{i}"], [None])
            wrapped.insert([f"{t}{i}"], [None])
    wrapped.access(["a0"])
    plain.access(["a0"])
    assert [wrapped.pop_victim() for _ in range(3)] == [plain.pop_victim() for _ in range(3)] == ["b0", "a1", "b1"]
    wrapped.set_limits({"a": 100})  # b has no quota: no protection, it goes first
    assert wrapped.partitioned and len(wrapped) == 9
    assert wrapped.pop_victim() == "b2"
    wrapped.set_limits(None)
    assert not wrapped.partitioned and len(wrapped) == 8 and wrapped.counts == {"a": 5, "b": 3}
    wrapped.check_integrity()


def test_a_tenant_over_its_soft_quota_loses_its_blocks_first_in_a_store(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=8)
    store.set_quotas(table(flood={"*": soft(0.5)}, chat={"*": soft(0.5)}))
    hot = chain(store, 3, salt=1, tenant="chat")
    store.put(hot, blocks_for(hot), tenant="chat")
    for salt in range(10, 40):  # the flood: one-off chains, far more than the tier holds
        keys = chain(store, 2, salt=salt, tenant="flood")
        store.put(keys, blocks_for(keys), tenant="flood")
    assert store.lookup(hot).num_blocks == 3  # under its share: untouched
    usage = store.view.tenant_stats()
    assert usage["chat"]["tiers"]["host"]["blocks"] == 3 and usage["flood"]["tiers"]["host"]["blocks"] == 5
    assert usage["chat"]["tiers"]["host"]["evictions_suffered"] == 0
    assert usage["flood"]["tiers"]["host"]["evictions_suffered"] == 60 - 5
    assert usage["flood"]["tiers"]["host"]["evictions_caused"] == 60 - 5
    store.check_integrity()
    store.close()


# ----------------------------------------------------------------------------- the hard quota


def test_hard_quota_makes_room_among_its_own_blocks_then_refuses_with_no_error(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=16)
    capped = TierQuota(hard=Limit(bytes=4 * SLOT))
    store.set_quotas(table(acme={"host": capped}))
    first = chain(store, 3, salt=1, tenant="acme")
    store.put(first, blocks_for(first), tenant="acme")
    second = chain(store, 3, salt=2, tenant="acme")
    store.put(second, blocks_for(second), tenant="acme")  # 6 > 4: its own oldest (first's tail) leave
    assert store.lookup(second).num_blocks == 3 and store.lookup(first).num_blocks == 1
    store.pin(second)
    store.pin(first[:1])
    third = chain(store, 2, salt=3, tenant="acme")
    store.put(third, blocks_for(third), tenant="acme")  # its 4 blocks pinned: refused, no error
    assert store.lookup(third).num_blocks == 0
    row = store.view.tenant_stats()["acme"]["tiers"]["host"]
    assert row["blocks"] == 4 and row["refused"] == 2 and row["hard_blocks"] == 4
    other = chain(store, 10, salt=4, tenant="globex")  # another tenant is not capped
    store.put(other, blocks_for(other), tenant="globex")
    assert store.lookup(other).num_blocks == 10
    store.check_integrity()
    store.close()


def test_reads_promote_within_the_hard_quota(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=16, disk_blocks=32)
    store.set_quotas(table(acme={"host": TierQuota(hard=Limit(bytes=4 * SLOT))}))
    chains = [chain(store, 4, salt=s, tenant="acme") for s in range(4)]
    for keys in chains:
        store.put(keys, blocks_for(keys), tenant="acme")  # each pushes the one before to disk
    assert store.lookup(chains[0]).tiers == ("disk",) * 4
    store.pin(chains[3][:2])  # two of its four host blocks cannot make room
    got = store.get(chains[0])  # read from disk: only what fits the quota is promoted
    assert torch.equal(got, blocks_for(chains[0]))
    row = store.view.tenant_stats()["acme"]["tiers"]["host"]
    assert row["blocks"] == 4 and row["refused"] == 0  # a read refuses nothing
    assert store.lookup(chains[0]).tiers == ("host", "host", "disk", "disk")
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_concurrent_puts_never_pass_a_hard_quota_by_one_block(tmp_path: Path, write_policy: str) -> None:
    caps = {"t0": 6, "t1": 9, "t2": 12}
    store = make_store(tmp_path, host_blocks=40, disk_blocks=200, write_policy=write_policy)
    store.set_quotas(table(**{t: {"host": TierQuota(soft=Limit(bytes=n * SLOT), hard=Limit(bytes=n * SLOT))}
                               for t, n in caps.items()}))
    done = threading.Event()
    worst: dict[str, int] = {}

    def watch() -> None:  # samples the usage while the puts run, from the store's own counts
        while not done.is_set():
            for tenant, usage in store.view.tenant_stats().items():
                worst[tenant] = max(worst.get(tenant, 0), usage["tiers"]["host"]["blocks"])

    watcher = threading.Thread(target=watch)
    watcher.start()

    def worker(i: int) -> None:
        tenant = f"t{i % 3}"
        rng = random.Random(i)
        for n in range(25):
            keys = chain(store, rng.randint(1, 8), salt=1000 * i + n, tenant=tenant)
            store.put(keys, blocks_for(keys), tenant=tenant)
            if rng.random() < 0.3:
                with contextlib.suppress(KeyError):  # refused at the quota, or evicted already
                    store.get(keys[:1])  # reads beside the puts

    try:
        run_in_threads(worker, 6)
    finally:
        done.set()
        watcher.join(30)
    final = store.view.tenant_stats()
    for tenant, cap in caps.items():
        assert worst[tenant] <= cap, f"{tenant} held {worst[tenant]} host blocks, cap {cap}"
        assert final[tenant]["tiers"]["host"]["blocks"] <= cap
    assert store.view.index_usage() == {t: {k: v["blocks"] for k, v in u["tiers"].items() if v["blocks"]}
                                   for t, u in final.items()}
    store.check_integrity()
    store.close()


# ----------------------------------------------------------------------------- usage counters


def test_usage_counters_match_the_index_after_a_storm(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=12, disk_blocks=30)
    store.set_quotas(table(a={"*": soft(0.3)}, b={"host": soft(0.5)}))

    def worker(i: int) -> None:
        tenant = "abc"[i % 3]
        rng = random.Random(i)
        for _ in range(40):
            keys = chain(store, rng.randint(1, 6), salt=rng.randint(0, 30), tenant=tenant)
            op = rng.random()
            if op < 0.6:
                store.put(keys, blocks_for(keys), tenant=tenant)
            elif op < 0.85:
                store.lookup(keys)
                with contextlib.suppress(KeyError):
                    store.get(keys)
            else:
                with contextlib.suppress(CapacityError):  # being read by another thread: a storm
                    store.delete(keys[-1:])

    run_in_threads(worker, 6)
    stats = store.view.tenant_stats()
    from_index = store.view.index_usage()
    assert from_index == {t: {k: v["blocks"] for k, v in u["tiers"].items() if v["blocks"]}
                          for t, u in stats.items() if u["blocks"]}
    tiers = store.stats()
    for tier in ("host", "disk"):
        assert sum(u["tiers"][tier]["blocks"] for u in stats.values()) == tiers[tier]["num_blocks"]
        assert sum(u["tiers"][tier]["evictions_suffered"] for u in stats.values()) == tiers[tier]["evictions"]
        assert sum(u["tiers"][tier]["hits"] for u in stats.values()) <= tiers[tier]["hits"]
    store.check_integrity()
    store.close()


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("doc", "message"), [
    ({"acme": {"host": {"soft": -1}}}, r"integer >= 0, got -1"),
    ({"acme": {"host": {"soft": 1.5}}}, r"share must be in \(0, 1\]"),
    ({"acme": {"host": {"soft": "0%"}}}, r"share must be in \(0, 1\]"),
    ({"acme": {"host": {"soft": "120%"}}}, r"share must be in \(0, 1\]"),
    ({"acme": {"host": {"soft": "50%", "hard": "25%"}}}, r"hard quota \(25%\) below the soft one \(50%\)"),
    ({"acme": {"host": {"softer": 1}}}, r"unknown keys \['softer'\]"),
    ({"acme": {"host": {"soft": True}}}, r"got True"),
    ({"acme": "lots"}, r"quotas.acme must be a table of tiers"),
])
def test_bad_quotas_are_clear_errors(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        QuotaTable.from_dict(doc)


def test_a_refused_quota_change_loses_nothing(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=8, disk_blocks=8)
    good = table(acme={"host": soft(0.5)})
    store.set_quotas(good)
    keys = chain(store, 3, tenant="acme")
    store.put(keys, blocks_for(keys), tenant="acme")
    for bad, message in ((table(acme={"remote": soft(0.5)}), "remote tier takes no quota"),
                         (table(acme={"ssd": soft(0.5)}), "no tier 'ssd'"),
                         (table(acme={"disk": TierQuota(hard=Limit(share=0.5))}), "hard quota applies to")):
        with pytest.raises(ConfigError, match=message):
            store.set_quotas(bad)
        assert store.quotas == good
    assert store.lookup(keys).num_blocks == 3
    assert store.view.tenant_stats()["acme"]["tiers"]["host"]["soft_blocks"] == 4
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("share", [1e-9, 1 / 3, 0.125, 0.9999999, 1.0])
def test_a_share_written_back_reads_back(share: float) -> None:
    """Found by the tokens_file and quotas fuzz harnesses (fuzz/regressions/quotas/): a share
    of 1e-9 ("0.0000001%") was written back as "0%", which reads back as no share at all."""
    shown = QuotaTable({"acme": {"host": TierQuota(soft=Limit(share=share))}}).as_dict()
    again = QuotaTable.from_dict(shown)
    assert again.as_dict() == shown
    assert again.tenants["acme"]["host"].soft.share == pytest.approx(share, rel=1e-5)  # type: ignore[union-attr]


def test_bytes_past_the_largest_size_are_refused() -> None:
    """Found by the quotas fuzz harness: an int limit skipped the size parser's bound (a string
    of the same number was refused)."""
    with pytest.raises(ConfigError, match=r"a quota of 100000000000000000000000 bytes is past the largest size"):
        QuotaTable.from_dict({"acme": {"host": {"hard": 10**23}}})
    assert Limit(bytes=(1 << 63) - 1).bytes == (1 << 63) - 1


def test_a_tenant_name_that_is_no_utf_8_is_refused() -> None:
    """Found by the quotas fuzz harness: JSON's "\\ud800" (a lone surrogate) made the name's
    length check raise UnicodeEncodeError."""
    with pytest.raises(ConfigError, match="a tenant name is a str of at most 255 UTF-8 bytes"):
        QuotaTable.from_dict({"\ud800": {"host": {"soft": "10%"}}})
