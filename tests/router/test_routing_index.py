"""KeyTable and PrefixIndex against plain Python models: sets per (replica, tier)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore.services.router.policy import CPU, DISK, GPU, REMOTE, KeyTable, PrefixIndex, TierWeights, key_ids
from kvstore.services.router.policy.keytable import MIN_CAPACITY


def keys(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}/{i}".encode()).digest() for i in range(n)]


def test_key_ids_take_the_first_eight_bytes_and_avoid_the_markers() -> None:
    ks = [bytes([5] + [0] * 31), bytes(32), bytes([1] + [0] * 15)[:16] * 2]
    assert key_ids(ks).tolist() == [5, 2, 3]
    assert key_ids([]).size == 0
    with pytest.raises(ValueError, match="multiple of 8"):
        key_ids([b"short"])
    with pytest.raises(ValueError, match="all be 32 bytes"):
        key_ids([bytes(32), bytes(16)])


def test_table_grows_rebuilds_and_frees_slots() -> None:
    table = KeyTable(num_columns=2)
    ids = key_ids(keys(5000))
    assert table.set_bits(ids, 0, 1).tolist() == [0] * 5000
    assert len(table) == 5000 and table.capacity > MIN_CAPACITY
    assert table.set_bits(ids[:10], 0, 1).tolist() == [1] * 10  # present: previous values
    table.set_bits(ids[:100], 1, 4)
    table.clear_bits(ids, 0, 1)
    assert len(table) == 100  # rows still holding column 1 stay
    table.check_integrity()
    table.clear_column(1)
    assert len(table) == 0
    table.set_bits(ids, 0, 2)  # tombstones are reused or dropped by a rebuild
    table.check_integrity()
    assert table.column_counts(0, 2) == 5000
    assert sorted(table.ids_with(0, 2).tolist()) == sorted(ids.tolist())


class TableModel(RuleBasedStateMachine):
    """The table against a dict {id: [mask per column]} through inserts, clears and rebuilds."""

    def __init__(self) -> None:
        super().__init__()
        self.table = KeyTable(num_columns=3, capacity=16)
        self.model: dict[int, list[int]] = {}
        self.pool = key_ids(keys(3000, "model"))

    @rule(start=st.integers(0, 2900), size=st.integers(1, 400), column=st.integers(0, 2),
          bit=st.sampled_from([1, 2, 4, 8, 16]))
    def set(self, start: int, size: int, column: int, bit: int) -> None:
        ids = self.pool[start:start + size]
        before = self.table.set_bits(ids, column, bit)
        assert before.tolist() == [self.model.get(i, [0, 0, 0])[column] for i in np.unique(ids).tolist()]
        for i in ids.tolist():
            self.model.setdefault(i, [0, 0, 0])[column] |= bit

    @rule(start=st.integers(0, 2900), size=st.integers(1, 400), column=st.integers(0, 2),
          bit=st.sampled_from([1, 2, 4, 8, 16, 0xFF]))
    def clear(self, start: int, size: int, column: int, bit: int) -> None:
        ids = self.pool[start:start + size]
        self.table.clear_bits(ids, column, bit)
        for i in ids.tolist():
            if i in self.model:
                self.model[i][column] &= ~bit
                if not any(self.model[i]):
                    del self.model[i]

    @rule(column=st.integers(0, 2), bit=st.sampled_from([1, 2, 0xFF]))
    def clear_column(self, column: int, bit: int) -> None:
        self.table.clear_column(column, bit)
        for i in list(self.model):
            self.model[i][column] &= ~bit
            if not any(self.model[i]):
                del self.model[i]

    @invariant()
    def agrees(self) -> None:
        assert len(self.table) == len(self.model)
        rows = self.table.rows(self.table.find(self.pool))
        expected = np.array([self.model.get(i, [0, 0, 0]) for i in self.pool.tolist()], dtype=np.uint8)
        assert (rows == expected).all()
        self.table.check_integrity()


TestTableModel = TableModel.TestCase
TestTableModel.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


def test_index_match_is_the_leading_run_weighted_by_best_tier() -> None:
    index = PrefixIndex(TierWeights(gpu=1.0, cpu=0.5, disk=0.25, remote=0.0))
    for name in ("a", "b", "c"):
        index.add_replica(name)
    chain = keys(8, "chain")
    index.stored("a", chain[:4], GPU)
    index.stored("a", chain[2:6], CPU)  # blocks 2-3 in both: best tier GPU
    index.stored("b", chain[:2], DISK)
    index.stored("b", chain[3:8], GPU)  # a hole at block 2: the run stops there
    index.stored("c", chain[1:8], GPU)  # no first block: nothing
    m = index.match(key_ids(chain))
    assert m.replicas == ("a", "b", "c")
    assert m.num_blocks.tolist() == [6, 2, 0]
    assert m.saved_blocks.tolist() == [4 + 2 * 0.5, 2 * 0.25, 0]
    assert m.tiers_of(0) == {GPU: 4, CPU: 2} and m.tiers_of(1) == {DISK: 2} and m.tiers_of(2) == {}
    assert index.num_blocks("a") == {GPU: 4, CPU: 4, DISK: 0, REMOTE: 0, "ROUTED": 0}
    index.check_integrity()


def test_index_removed_cleared_and_replicas() -> None:
    index = PrefixIndex()
    index.add_replica("a")
    index.add_replica("b")
    chain = keys(6, "x")
    assert index.stored("a", chain, GPU) == 6
    assert index.stored("a", chain, GPU) == 0  # already there
    index.stored("a", chain, DISK)
    index.stored("b", chain[:3], GPU)
    assert index.removed("a", chain[4:], GPU) == 2
    assert index.removed("a", keys(3, "unknown"), GPU) == 0
    assert index.match(key_ids(chain)).num_blocks.tolist() == [6, 3]  # disk still holds 4-5
    index.cleared("a", DISK)
    assert index.match(key_ids(chain)).num_blocks.tolist() == [4, 3]
    index.cleared("a")
    assert index.num_blocks("a")[GPU] == 0 and len(index) == 3
    assert sorted(index.held_ids("b", GPU).tolist()) == sorted(key_ids(chain[:3]).tolist())
    index.remove_replica("b")
    assert len(index) == 0 and index.replicas == ("a",)
    index.add_replica("c")  # reuses b's column, which is clean
    assert index.match(key_ids(chain)).num_blocks.tolist() == [0, 0]
    index.check_integrity()
    with pytest.raises(KeyError, match="not in the index"):
        index.stored("zz", chain, GPU)
    with pytest.raises(ValueError, match="unknown medium"):
        index.stored("a", chain, "HBM")


def test_tier_weights_from_costs() -> None:
    w = TierWeights.from_costs()
    assert w.gpu == 1.0 and w.cpu > w.disk > w.remote >= 0.0
    assert (round(w.cpu, 2), round(w.disk, 2), round(w.remote, 2)) == (TierWeights().cpu, TierWeights().disk,
                                                                        TierWeights().remote)
    assert TierWeights.from_costs(disk_gbps=0.01).disk == 0.0  # slower than recompute: worthless
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        TierWeights(cpu=1.5)


def test_a_million_blocks_on_eight_replicas_take_under_40_bytes_each() -> None:
    index = PrefixIndex()
    for r in range(8):
        index.add_replica(f"r{r}")
    ids = np.random.default_rng(0).integers(2, 1 << 63, size=1_000_000, dtype=np.uint64)
    for r in range(8):
        index.routed(f"r{r}", ids[r % 4::4])  # every block on two replicas (ids API)
    assert len(index) == 1_000_000
    assert index.nbytes / len(index) < 40, f"{index.nbytes / len(index):.1f} bytes per block"
    assert index.match(ids[:128]).num_blocks.tolist() == [1, 0, 0, 0, 1, 0, 0, 0]
