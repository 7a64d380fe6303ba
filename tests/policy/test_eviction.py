"""Eviction policies: exact orders, the reuse policy's idea, leaves first, a model check."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.policy.eviction import (
    DEFAULT_POLICY,
    POLICIES,
    DeferredAccess,
    EvictionPolicy,
    LRUPolicy,
    ReusePolicy,
    make_policy,
)


def chain(name: str, n: int) -> tuple[list[str], list[str | None]]:
    keys = [f"{name}{i}" for i in range(n)]
    return keys, [None, *keys[:-1]]


def drain(policy: EvictionPolicy) -> list[object]:
    out = []
    while (key := policy.pop_victim()) is not None:
        out.append(key)
    return out


# ----------------------------------------------------------------------------- LRU


def test_lru_evicts_tails_first_then_older_chains() -> None:
    lru = LRUPolicy()
    lru.insert(*chain("a", 3))
    lru.insert(*chain("b", 2))
    assert drain(lru) == ["a2", "a1", "a0", "b1", "b0"]


def test_lru_access_refreshes_a_chain() -> None:
    lru = LRUPolicy()
    lru.insert(*chain("a", 2))
    lru.insert(*chain("b", 2))
    lru.access(["a0", "a1"])
    assert drain(lru) == ["b1", "b0", "a1", "a0"]


def test_lru_skips_blocks_it_may_not_evict() -> None:
    lru = LRUPolicy()
    lru.insert(*chain("a", 3))
    assert lru.pop_victim(lambda k: k != "a2") == "a1"
    assert "a2" in lru and len(lru) == 2
    assert lru.pop_victim(lambda k: False) is None
    assert len(lru) == 2


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_cooled_blocks_go_first_tails_first_and_an_access_warms_them(name: str) -> None:
    """A sliding window's blocks below the window of its chain's used boundaries are cooled:
    they leave before every other block (their tail first), until a hit uses them again."""
    policy = make_policy(name)
    policy.insert(*chain("a", 4))
    policy.insert(*chain("b", 2))
    policy.cool(["a0", "a1", "zz"])  # an unknown key is ignored
    assert policy.pop_victim() == "a1" and policy.pop_victim() == "a0"
    policy.insert(*chain("c", 2))
    policy.cool(["c0", "c1"])
    policy.access(["c0", "c1"])  # a hit: warm again, the newest
    victims = drain(policy)
    assert victims[-2:] == ["c1", "c0"] and set(victims) == {"a2", "a3", "b0", "b1", "c0", "c1"}
    policy.check_integrity()


def test_a_cooled_reused_block_leaves_before_once_seen_ones() -> None:
    policy = ReusePolicy(min_samples=1)
    policy.insert(*chain("a", 2))
    policy.access(["a0", "a1"])  # reused: protected within the horizon
    policy.insert(*chain("b", 2))
    policy.cool(["a0", "a1"])
    assert drain(policy)[:2] == ["a1", "a0"]
    policy.check_integrity()


# ----------------------------------------------------------------------------- the reuse policy


def test_registry_knows_the_default() -> None:
    assert DEFAULT_POLICY == "reuse" and isinstance(make_policy("reuse"), ReusePolicy)
    assert set(POLICIES) >= {"lru", "reuse"}
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        make_policy("nope")


def test_reused_block_outlives_newer_once_seen_blocks_within_the_horizon() -> None:
    policy = ReusePolicy()
    policy.horizon = 50  # as learned: reuses have taken up to ~50 block touches
    policy.insert(["s"], [None])
    policy.access(["s"])  # seen twice: reused
    policy.insert(*chain("x", 3))  # a newer chain nobody has asked for again
    assert drain(policy) == ["x2", "x1", "x0", "s"]  # LRU would evict s first
    policy.check_integrity()


def test_reused_block_older_than_the_horizon_goes_in_lru_order() -> None:
    policy = ReusePolicy()
    policy.horizon = 2
    policy.insert(["s"], [None])
    policy.access(["s"])
    policy.insert(*chain("x", 3))
    assert drain(policy) == ["s", "x2", "x1", "x0"]


def test_ghost_list_remembers_an_evicted_block_was_seen() -> None:
    policy = ReusePolicy()
    policy.horizon = 10**9
    policy.insert(["a"], [None])
    assert policy.pop_victim() == "a"
    policy.insert(["a"], [None])  # back after eviction: its second sighting, so reused
    policy.insert(["b"], [None])
    assert drain(policy) == ["b", "a"]


def test_horizon_is_the_quantile_of_observed_reuse_intervals() -> None:
    policy = ReusePolicy()
    keys = list(range(100))
    policy.insert(keys, [None] * 100)
    for _ in range(5):
        for key in keys:  # each block comes back exactly 100 touches after its last use
            policy.access([key])
    assert policy.horizon == 0 or 100 <= policy.horizon <= 111  # 4 log buckets per octave
    for _ in range(3):
        for key in keys:
            policy.access([key])
    assert 100 <= policy.horizon <= 111


def test_without_history_the_reuse_policy_is_exactly_lru() -> None:
    rng = random.Random(7)
    for _ in range(30):
        lru, reuse = LRUPolicy(), ReusePolicy(min_samples=10**9)
        for step in range(300):
            op = rng.random()
            tracked = sorted(lru._order, key=str)  # type: ignore[attr-defined]
            if op < 0.35 or not tracked:
                keys = [f"k{rng.randrange(60)}" for _ in range(rng.randint(1, 4))]
                keys = list(dict.fromkeys(k for k in keys if k not in lru))
                for p in (lru, reuse):
                    p.insert(keys, [None] * len(keys))
            elif op < 0.7:
                keys = rng.sample(tracked, min(len(tracked), rng.randint(1, 3)))
                for p in (lru, reuse):
                    p.access(keys)
            elif op < 0.8:
                key = rng.choice(tracked)
                for p in (lru, reuse):
                    p.remove(key)
            else:
                banned = set(rng.sample(tracked, len(tracked) // 3))
                assert lru.pop_victim(lambda k, b=banned: k not in b) == reuse.pop_victim(
                    lambda k, b=banned: k not in b), f"step {step}"
            assert len(lru) == len(reuse)
        assert drain(lru) == drain(reuse)


# ----------------------------------------------------------------------------- leaves first


def serve(policy: EvictionPolicy, held: set[str], keys: list[str], capacity: int, insert_first: bool) -> None:
    """One request the way a store serves it; asserts the tier stays prefix-closed."""
    present = [k in held for k in keys]
    need = present.count(False)
    while len(held) + need > capacity:
        victim = policy.pop_victim(lambda k: k not in keys)
        assert victim is not None
        held.discard(victim)  # type: ignore[arg-type]
        parents = {k[:-1] for k in held}
        assert victim not in parents, f"evicted {victim} while a child of it stays"
    found = keys[: present.index(False)] if False in present else keys
    new = keys[len(found):]
    calls = [("insert", new), ("access", found)] if insert_first else [("access", found), ("insert", new)]
    for kind, part in calls:
        if not part:
            continue
        if kind == "insert":
            first = keys.index(part[0])
            policy.insert(part, [keys[first - 1] if first else None, *part[:-1]])
            held.update(part)
        else:
            policy.access(part)
    assert len(policy) == len(held) and all(k in policy for k in held)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    capacity=st.integers(4, 24),
    horizon=st.sampled_from([None, 0, 3, 40, 10**9]),
    insert_first=st.booleans(),
)
def test_reuse_policy_never_cuts_a_prefix(seed: int, capacity: int, horizon: int | None, insert_first: bool) -> None:
    # Keys are paths in a small tree ("a", "ab", "abc"...): the parent of a key is key[:-1].
    rng = random.Random(seed)
    policy = ReusePolicy(min_samples=4)
    held: set[str] = set()
    for _ in range(150):
        depth = rng.randint(1, min(8, capacity))
        path = "".join(rng.choice("ab" if i < 2 else "abcd") for i in range(depth))
        if horizon is not None:
            policy.horizon = horizon
        serve(policy, held, [path[: i + 1] for i in range(depth)], capacity, insert_first)
        policy.check_integrity()


# ----------------------------------------------------------------------------- model check


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("iarpc"), st.integers(0, 40), st.integers(1, 4)), max_size=120))
def test_reuse_policy_tracks_exactly_the_model_set(ops: list[tuple[str, int, int]]) -> None:
    policy, model = ReusePolicy(min_samples=1), set()
    for op, a, b in ops:
        if op == "i":
            keys = [k for k in dict.fromkeys(range(a, a + b)) if k not in model]
            policy.insert(keys, [None, *keys[:-1]])
            model.update(keys)
        elif op == "a":
            keys = [k for k in range(a, a + b) if k in model]
            policy.access(keys)
        elif op == "c":
            cooled = list(range(a, a + b))
            policy.cool(cooled)
            if any(k in model for k in cooled):  # the cooled tail leaves first
                assert policy.peek_victim() == max(k for k in cooled if k in model)
        elif op == "r":
            policy.remove(a)
            model.discard(a)
        else:
            victim = policy.pop_victim(lambda k, a=a, b=b: (k + a) % (b + 1) != 0)
            if victim is None:
                assert all((k + a) % (b + 1) == 0 for k in model)
            else:
                assert victim in model and (victim + a) % (b + 1) != 0
                model.discard(victim)
        assert len(policy) == len(model)
        assert all(k in policy for k in model) and not any(k in policy for k in range(-5, 0))
        policy.check_integrity()


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(POLICIES)), max_pending=st.sampled_from([1, 3, 1000]),
       ops=st.lists(st.tuples(st.sampled_from("iiaaarpc"), st.integers(0, 30), st.integers(1, 6)), max_size=150))
def test_deferred_access_decides_exactly_as_the_policy_it_wraps(name: str, max_pending: int,
                                                               ops: list[tuple[str, int, int]]) -> None:
    """Hits recorded now and replayed at the next decision change no decision: the same ops on
    a wrapped and a plain policy give the same victims, sizes and memberships."""
    plain, deferred = make_policy(name), DeferredAccess(make_policy(name), max_pending=max_pending)
    held: set[int] = set()
    for op, a, b in ops:
        if op == "i":
            keys = [k for k in range(a, a + b) if k not in held]
            for policy in (plain, deferred):
                policy.insert(keys, [None, *keys[:-1]])
            held.update(keys)
        elif op == "a":
            keys = [k for k in range(a, a + b) if k in held]
            plain.access(keys)
            deferred.access(list(keys))
            assert deferred.num_pending < max_pending  # the log never outgrows its bound
        elif op == "r":
            plain.remove(a)
            deferred.remove(a)
            held.discard(a)
        elif op == "c":
            plain.cool(list(range(a, a + b)))
            deferred.cool(list(range(a, a + b)))
        else:
            victim = plain.pop_victim(lambda k, b=b: k % (b + 1) != 0)
            assert deferred.pop_victim(lambda k, b=b: k % (b + 1) != 0) == victim
            held.discard(victim)  # type: ignore[arg-type]
    assert len(deferred) == len(plain) == len(held)
    assert drain(deferred) == drain(plain)
    deferred.check_integrity()
