"""TieredStore under several threads, and held against a plain-dict model (Hypothesis)."""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore import CapacityError, TieredStore

from factories import blocks_for, chain, make_store, run_in_threads


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
@pytest.mark.parametrize("locked_copy_bytes", [64 << 20, 0], ids=["host-copy-under-lock", "host-copy-marked-read"])
def test_threads_put_get_lookup_fetch_concurrently(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   locked_copy_bytes: int, write_policy: str) -> None:
    """Both ways a host-only get copies (under the store lock, or with its blocks marked as
    being read when it is too large for that) hold under concurrent puts and evictions; under
    write-through, with puts writing to disk outside the lock, some of the same chains."""
    monkeypatch.setattr("kvstore.reads.LOCKED_COPY_BYTES", locked_copy_bytes)
    store = make_store(tmp_path, host_blocks=12, disk_blocks=40, write_policy=write_policy)
    chains = [chain(store, 1 + s % 4, salt=s) for s in range(30)]
    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(150):
            keys = rng.choice(chains)
            op = rng.random()
            if op < 0.35:
                store.put(keys, blocks_for(keys))
            elif op < 0.6:
                found = store.lookup(keys).num_blocks
                if found:
                    try:
                        got = store.get(keys[:found])
                    except KeyError:
                        continue  # evicted between lookup and get: a miss, never wrong bytes
                    assert torch.equal(got, blocks_for(keys[:found]))
            elif op < 0.85:
                into = torch.full((len(keys), *store.layout.block_shape), float("nan"))
                n = store.fetch(keys, into=into).result(timeout=30).num_blocks
                assert torch.equal(into[:n], blocks_for(keys[:n]))
            elif op < 0.92:
                with contextlib.suppress(CapacityError):  # some block is pinned or being read
                    store.delete(keys)
            else:
                try:
                    store.pin(keys)
                except KeyError:
                    continue
                store.unpin(keys)

    run_in_threads(worker, 6)
    stats = store.stats()
    assert stats["host"]["used_bytes"] <= stats["host"]["capacity_bytes"]
    assert stats["disk"]["used_bytes"] <= stats["disk"]["capacity_bytes"]
    store.check_integrity()
    store.close()


class HeldUpListener:
    """Holds up the first put it hears of, with the store lock held (as a long disk write
    under write-through holds it), until ``gate`` is set."""

    def __init__(self) -> None:
        self.inside, self.gate = threading.Event(), threading.Event()

    def blocks_stored(self, tier: str, keys: list[bytes], parents: list[bytes | None]) -> None:
        self.inside.set()
        self.gate.wait(10)

    def blocks_removed(self, tier: str, keys: list[bytes]) -> None:
        pass


@contextlib.contextmanager
def lock_held_by_a_put(store: TieredStore, num_blocks: int) -> Iterator[list[bytes]]:
    """While the block runs, another thread's put of a new ``num_blocks``-block chain holds
    the store lock (held up by a listener); afterwards the put goes through. Yields its keys."""
    listener = HeldUpListener()
    store.add_listener(listener)
    keys = chain(store, num_blocks, salt=2)
    putter = threading.Thread(target=store.put, args=(keys, blocks_for(keys)))
    putter.start()
    try:
        assert listener.inside.wait(30)  # the put holds the store lock now
        yield keys
    finally:
        listener.gate.set()
        putter.join(30)


def test_a_lookup_does_not_wait_for_the_store_lock(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=8, disk_blocks=16)
    held = chain(store, 2, salt=1)
    store.put(held, blocks_for(held))
    hits = store.stats()["host"]["hits"]
    with lock_held_by_a_put(store, 2) as other:
        started = time.monotonic()
        matches = [store.lookup(held) for _ in range(5)]
        waited = time.monotonic() - started
        assert store.lookup(chain(store, 1, salt=3)).num_blocks == 0
    assert waited < 2.0, f"lookups waited {waited:.1f} s for the lock"
    assert all(m.num_blocks == 2 and m.tiers == ("host", "host") for m in matches)
    assert store.lookup(other).num_blocks == 2  # the put went through
    # made without the lock, counted once it was free: 5 lookups of 2 host blocks, 1 more now
    assert store.stats()["host"]["hits"] == hits + 12
    store.check_integrity()
    store.close()


NUM_CHAINS = 6


class StoreModel(RuleBasedStateMachine):
    """The store against a dict of what was put: found keys always hold exactly those bytes.

    The disk tier is large enough to hold every block, so nothing is ever dropped: with
    write-back, every block put is found (host or disk), also after close and reopen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvstore-model-"))
        self.host_blocks = 3
        self.store = make_store(self.dir, host_blocks=self.host_blocks, disk_blocks=64)
        self.chains = [chain(self.store, 1 + s % 3, salt=s) for s in range(NUM_CHAINS)]
        self.model: dict[bytes, torch.Tensor] = {}

    @rule(c=st.integers(0, NUM_CHAINS - 1), n=st.integers(1, 3))
    def put(self, c: int, n: int) -> None:
        keys = self.chains[c][:n]
        self.store.put(keys, blocks_for(keys))
        for key in keys:
            self.model[key] = blocks_for([key])[0]

    @rule(c=st.integers(0, NUM_CHAINS - 1))
    def lookup_and_get(self, c: int) -> None:
        keys = self.chains[c]
        expected = 0
        while expected < len(keys) and keys[expected] in self.model:
            expected += 1
        match = self.store.lookup(keys)
        assert match.num_blocks == expected
        if expected:
            got = self.store.get(keys[:expected])
            assert torch.equal(got, torch.stack([self.model[k] for k in keys[:expected]]))

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def pin_unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.store.pin([key])
        self.store.unpin([key])

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = make_store(self.dir, host_blocks=self.host_blocks, disk_blocks=64)

    @invariant()
    def integrity(self) -> None:
        self.store.check_integrity()
        assert self.store.stats()["host"]["num_blocks"] <= self.host_blocks

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreModel.TestCase.settings = settings(
    max_examples=25, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_store_matches_dict_model = StoreModel.TestCase


def test_lookups_uncounted_past_the_bound_wait_for_the_lock_once(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue of lookups made without the lock stays bounded when the lock is never free
    at a lookup: past the bound, a lookup waits for the lock and counts them all."""
    monkeypatch.setattr("kvstore.store.MAX_UNCOUNTED_LOOKUPS", 3)
    store = make_store(tmp_path, host_blocks=8, disk_blocks=16)
    held = chain(store, 1, salt=1)
    store.put(held, blocks_for(held))
    hits = store.stats()["host"]["hits"]
    with lock_held_by_a_put(store, 1):
        for _ in range(3):
            store.lookup(held)  # without the lock: queued
        waiter = threading.Thread(target=store.lookup, args=(held,))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # the fourth waits for the lock
    waiter.join(30)
    assert not waiter.is_alive()
    assert store.stats()["host"]["hits"] == hits + 4
    store.close()
