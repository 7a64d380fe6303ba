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
from kvstore.tiers.host import HostTier

from factories import blocks_for, chain, make_store, run_in_threads
from waiting import wait_blocked


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
@pytest.mark.parametrize("locked_copy_bytes", [64 << 20, 0], ids=["host-copy-under-lock", "host-copy-marked-read"])
@pytest.mark.parametrize("unlocked_put_bytes", [1 << 40, 0], ids=["put-copy-under-lock", "put-copy-unlocked"])
def test_threads_put_get_lookup_fetch_concurrently(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   locked_copy_bytes: int, write_policy: str,
                                                   unlocked_put_bytes: int) -> None:
    """Both ways a host-only get copies (under the store lock, or with its blocks marked as
    being read when it is too large for that) hold under concurrent puts and evictions; under
    write-through, with puts writing to disk outside the lock, some of the same chains; under
    write-back, with puts copying into host RAM outside the lock (``unlocked_put_bytes`` 0:
    every put does)."""
    monkeypatch.setattr("kvstore.store.reads.LOCKED_COPY_BYTES", locked_copy_bytes)
    monkeypatch.setattr("kvstore.store.writes.UNLOCKED_COPY_BYTES", unlocked_put_bytes)
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

    def blocks_stored(self, tier: str, keys: list[bytes], parents: list[bytes | None],
                      groups: list[int | None]) -> None:
        self.inside.set()
        self.gate.wait(10)

    def blocks_removed(self, tier: str, keys: list[bytes], groups: list[int | None]) -> None:
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


class HeldUpHostCopy:
    """Holds up the host-RAM copies of puts of ``num_blocks`` blocks until ``gate`` is set
    (the real copy then runs), or makes them fail with ``fail``. Each held-up copy first asks,
    from another thread, whether the store lock is free (``contains(blocking=False)``)."""

    def __init__(self, store: TieredStore, num_blocks: int, probe: list[bytes]) -> None:
        self.store, self.num_blocks, self.probe = store, num_blocks, probe
        self.inside, self.gate = threading.Event(), threading.Event()
        self.lock_free: list[bool] = []  # per held-up copy: the store lock was free during it
        self.fail: Exception | None = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = HostTier.write

        def write(tier: HostTier, slots: list[int], src: torch.Tensor) -> None:
            if len(slots) == self.num_blocks:
                answer: list[list[bool] | None] = []
                prober = threading.Thread(target=lambda: answer.append(self.store.contains(self.probe, blocking=False)))
                prober.start()
                prober.join(10)
                self.lock_free.append(answer == [[True] * len(self.probe)])
                if self.fail is not None:
                    raise self.fail
                self.inside.set()
                self.gate.wait(10)
            real(tier, slots, src)

        monkeypatch.setattr(HostTier, "write", write)


class StoredKeys:
    """A listener that records the keys host RAM announced."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []

    def blocks_stored(self, tier: str, keys: list[bytes], parents: list[bytes | None],
                      groups: list[int | None]) -> None:
        if tier == "host":
            self.keys += keys

    def blocks_removed(self, tier: str, keys: list[bytes], groups: list[int | None]) -> None:
        pass


def test_a_big_puts_copy_runs_outside_the_store_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put of ``UNLOCKED_COPY_BYTES`` or more copies into host RAM with the store lock free:
    gets of other blocks go on meanwhile; its own blocks are found by lookups and waited for
    by gets (which then return exactly the bytes put), and are announced once copied."""
    store = make_store(tmp_path, host_blocks=16, disk_blocks=32)
    payload = store.layout.bytes_per_block
    monkeypatch.setattr("kvstore.store.writes.UNLOCKED_COPY_BYTES", 4 * payload)
    held = chain(store, 2, salt=1)
    store.put(held, blocks_for(held))
    copies = HeldUpHostCopy(store, 4, probe=held)
    copies.install(monkeypatch)
    stored = StoredKeys()
    store.add_listener(stored)
    big = chain(store, 4, salt=2)
    putter = threading.Thread(target=store.put, args=(big, blocks_for(big)))
    putter.start()
    got: list[torch.Tensor] = []
    try:
        assert copies.inside.wait(30)  # the big put is copying now
        started = time.monotonic()
        assert torch.equal(store.get(held), blocks_for(held))
        waited = time.monotonic() - started
        assert store.lookup(big).tiers == ("host",) * 4
        assert store.contains(big) == [True] * 4
        assert not set(big) & set(stored.keys)  # not announced before their bytes are in
        # a shared-memory lease (the daemon's) never hands out a slot still being copied into
        assert store.host_leases.acquire(big) == [] and store.host_leases.acquire(big, host_only=True) == []
        reader = threading.Thread(target=lambda: got.append(store.get(big)))
        reader.start()
    finally:
        copies.gate.set()
        putter.join(30)
    reader.join(30)
    assert waited < 2.0, f"a get of other blocks waited {waited:.1f} s for the put's copy"
    assert copies.lock_free == [True]
    assert len(got) == 1 and torch.equal(got[0], blocks_for(big))
    assert set(big) <= set(stored.keys)
    store.check_integrity()
    store.close()


def test_a_small_puts_copy_holds_the_store_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(tmp_path, host_blocks=16)
    monkeypatch.setattr("kvstore.store.writes.UNLOCKED_COPY_BYTES", 4 * store.layout.bytes_per_block)
    held = chain(store, 2, salt=1)
    store.put(held, blocks_for(held))
    copies = HeldUpHostCopy(store, 3, probe=held)
    copies.install(monkeypatch)
    copies.gate.set()
    keys = chain(store, 3, salt=2)
    store.put(keys, blocks_for(keys))
    assert copies.lock_free == [False]
    assert torch.equal(store.get(keys), blocks_for(keys))
    store.close()


def test_a_put_whose_unlocked_copy_fails_keeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy raises: so does the put, none of its blocks is found, its slots are free
    again, and the same put succeeds afterwards."""
    store = make_store(tmp_path, host_blocks=16, disk_blocks=32)
    monkeypatch.setattr("kvstore.store.writes.UNLOCKED_COPY_BYTES", 0)
    held = chain(store, 2, salt=1)
    store.put(held, blocks_for(held))
    used = store.stats()["host"]["used_bytes"]
    copies = HeldUpHostCopy(store, 4, probe=held)
    copies.fail = RuntimeError("the copy broke")
    copies.install(monkeypatch)
    keys = chain(store, 4, salt=2)
    with pytest.raises(RuntimeError, match="the copy broke"):
        store.put(keys, blocks_for(keys))
    assert store.lookup(keys).num_blocks == 0
    assert store.contains(keys) == [False] * 4
    assert store.stats()["host"]["used_bytes"] == used
    store.check_integrity()
    copies.fail = None
    copies.gate.set()
    store.put(keys, blocks_for(keys))
    assert torch.equal(store.get(keys), blocks_for(keys))
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
    monkeypatch.setattr("kvstore.store.tiered.MAX_UNCOUNTED_LOOKUPS", 3)
    store = make_store(tmp_path, host_blocks=8, disk_blocks=16)
    held = chain(store, 1, salt=1)
    store.put(held, blocks_for(held))
    hits = store.stats()["host"]["hits"]
    with lock_held_by_a_put(store, 1):
        for _ in range(3):
            store.lookup(held)  # without the lock: queued
        waiter = threading.Thread(target=store.lookup, args=(held,))
        waiter.start()
        wait_blocked(waiter, "locked", what="the fourth lookup")  # Cascade.locked: it takes the store lock
        assert waiter.is_alive()  # the fourth waits for the lock
    waiter.join(30)
    assert not waiter.is_alive()
    assert store.stats()["host"]["hits"] == hits + 4
    store.close()
