"""Router decisions: affinity, tiers, tenants, pending guesses, the gate, modes and policies."""

from __future__ import annotations

import pytest
import torch

from kvstore.keys import BlockHasher, Namespace
from kvstore.layout import KVLayout
from kvstore.services.router.policy import (
    CPU,
    DISK,
    GPU,
    REMOTE,
    LoadReport,
    Router,
    RoutingError,
    RoutingPolicyConfig,
)

BLOCK = 16
NAMESPACE = Namespace("router-test", KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=BLOCK,
                                             dtype=torch.float32))
HASHER = BlockHasher(NAMESPACE)
REPLICAS = ("a", "b", "c")


def make_router(**config: object) -> Router:
    router = Router(BLOCK, RoutingPolicyConfig(**config), HASHER)  # type: ignore[arg-type]
    for name in REPLICAS:
        router.add_replica(name)
    return router


def prompt(salt: int, num_tokens: int = 10 * BLOCK) -> list[int]:
    return [salt * 100_000 + i for i in range(num_tokens)]


def store(router: Router, replica: str, tokens: list[int], medium: str = GPU, tenant: str = "") -> None:
    router.stored(replica, HASHER.block_keys(tokens, tenant), medium)


def test_a_request_goes_where_its_prefix_is() -> None:
    router = make_router()
    store(router, "b", prompt(1)[: 6 * BLOCK])
    d = router.route(prompt(1), now=0.0)
    assert (d.replica, d.reason) == ("b", "cache_hit")
    assert d.predicted_cached_tokens == 6 * BLOCK and d.predicted_by_tier == {GPU: 6}
    assert d.prompt_tokens == 10 * BLOCK and 0 < d.seconds < 1


def test_the_longest_prefix_wins_and_device_beats_lower_tiers() -> None:
    router = make_router()
    store(router, "a", prompt(1)[: 4 * BLOCK])
    store(router, "b", prompt(1)[: 8 * BLOCK], DISK)  # longer, but on disk (weight 0.56)
    store(router, "c", prompt(1)[: 6 * BLOCK], CPU)
    d = router.route(prompt(1), now=0.0)
    assert d.replica == "c" and d.predicted_by_tier == {CPU: 6}  # 6 x 0.93 > 8 x 0.56 > 4


@pytest.mark.parametrize("shared", [False, True])
def test_a_shared_remote_tier_counts_for_every_replica(shared: bool) -> None:
    router = make_router(shared_remote=shared)
    store(router, "a", prompt(13), REMOTE)  # a wrote all 10 blocks to the remote tier
    store(router, "b", prompt(13)[: 5 * BLOCK])  # b holds the first 5 on its device
    d = router.route(prompt(13), now=0.0)
    assert d.replica == "b"
    assert d.predicted_by_tier == ({GPU: 5, REMOTE: 5} if shared else {GPU: 5})
    assert d.predicted_cached_tokens == (10 if shared else 5) * BLOCK  # found whole when shared


def test_tenants_never_share_a_prefix() -> None:
    router = make_router()
    store(router, "c", prompt(2), tenant="alice")
    bob = router.route(prompt(2), tenant="bob", now=0.0)
    assert bob.reason == "no_prefix" and bob.predicted_cached_tokens == 0
    alice = router.route(prompt(2), tenant="alice", now=0.0)
    assert (alice.replica, alice.reason) == ("c", "cache_hit")


def test_back_to_back_turns_follow_the_pending_guess_until_it_expires() -> None:
    router = make_router(pending_ttl_s=2.0)
    first = router.route(prompt(3, 4 * BLOCK), now=0.0)  # no events yet for anything
    assert first.reason == "no_prefix"
    second = router.route(prompt(3, 8 * BLOCK), now=0.5)
    assert (second.replica, second.reason) == (first.replica, "pending")
    assert second.predicted_by_tier == {"ROUTED": 4}
    for d in (first, second):
        router.finished(d, prefill_done=False)
    assert router.index.num_blocks(first.replica)["ROUTED"] == 8
    late = router.route(prompt(3, 8 * BLOCK), now=10.0)  # guesses expired, events never came
    assert late.reason == "no_prefix"


def test_approximate_mode_routes_from_history_and_leaves_it() -> None:
    router = make_router(pending_ttl_s=1.0)
    d = router.route(prompt(4), now=0.0)
    router.finished(d)
    router.set_approximate(d.replica, True, now=0.5)
    again = router.route(prompt(4), now=100.0)  # long after the TTL: still remembered
    assert (again.replica, again.reason) == (d.replica, "approximate")
    router.finished(again)
    router.set_approximate(d.replica, False, now=200.0)  # events back: old guesses go
    assert router.index.num_blocks(d.replica)["ROUTED"] == 0


def test_the_gate_spreads_a_hot_prefix() -> None:
    router = make_router(gate_min_requests=1)
    store(router, "a", prompt(5)[: 9 * BLOCK])
    decisions = [router.route(prompt(5)[: 9 * BLOCK] + prompt(100 + i, BLOCK), now=0.0) for i in range(30)]
    counts = {name: router.replicas[name].in_flight for name in REPLICAS}
    assert sum(counts.values()) == 30 and max(counts.values()) <= 1.5 * 30 / 3, counts
    assert {d.reason for d in decisions} >= {"cache_hit", "overload_gate"}
    for d in decisions:
        router.finished(d)
    assert all(router.replicas[name].in_flight == 0 for name in REPLICAS)
    assert router.reasons["overload_gate"] > 0


def test_without_the_gate_a_hot_prefix_piles_up() -> None:
    # The control: the same burst with the gate's slack set beyond it stays on "a".
    router = make_router(gate_min_requests=1000, gate_min_tokens=10**9)
    store(router, "a", prompt(5)[: 9 * BLOCK])
    for i in range(30):
        router.route(prompt(5)[: 9 * BLOCK] + prompt(100 + i, BLOCK), now=0.0)
    assert router.replicas["a"].in_flight > 15


def test_load_moves_a_request_off_a_busy_replica() -> None:
    router = make_router()
    store(router, "a", prompt(6)[: 6 * BLOCK])
    router.update_load("a", LoadReport(queued_prefill_tokens=50_000))
    d = router.route(prompt(6), now=0.0)  # saving 96 tokens is not worth a 50k-token queue
    assert d.replica != "a" and d.reason == "load"
    router.update_load("a", LoadReport(queued_prefill_tokens=100_000))  # past the token gate
    long = prompt(11, 1875 * BLOCK)  # 30,000 tokens, all on "a": the cost alone would pick it
    store(router, "a", long)
    d = router.route(long, now=0.0)
    assert d.replica != "a" and d.reason == "overload_gate"


def test_round_robin_and_least_loaded_behave_as_named() -> None:
    rr = make_router(policy="round_robin")
    store(rr, "c", prompt(7))
    assert [rr.route(prompt(7), now=0.0).replica for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    ll = make_router(policy="least_loaded")
    store(ll, "c", prompt(7))
    ll.update_load("a", LoadReport(queued_prefill_tokens=5000))
    ll.update_load("c", LoadReport(queued_prefill_tokens=9000))
    d = ll.route(prompt(7), now=0.0)
    assert (d.replica, d.reason) == ("b", "least_loaded")
    # the router's own routed prefill counts before the replica reports it
    assert ll.replicas["b"].routed_prefill_tokens == 10 * BLOCK
    assert ll.route(prompt(8, 400 * BLOCK), now=0.0).replica == "b"  # 160 < 5000 tokens
    assert ll.route(prompt(9), now=0.0).replica == "a"  # b's 6,560 routed tokens > a's 5,000


def test_unhealthy_replicas_are_skipped_and_forgotten() -> None:
    router = make_router()
    store(router, "a", prompt(10))
    router.set_healthy("a", False)
    assert router.index.num_blocks("a")[GPU] == 0  # a dead replica holds nothing
    assert {router.route(prompt(10), now=0.0).replica for _ in range(4)} <= {"b", "c"}
    router.set_healthy("a", True)
    for name in ("a", "b", "c"):
        router.set_healthy(name, False)
    with pytest.raises(RoutingError, match="no healthy replica among 3"):
        router.route(prompt(10), now=0.0)
    router.index.check_integrity()


def test_a_prefix_below_min_match_does_not_count() -> None:
    router = make_router()
    system = prompt(12)[: 2 * BLOCK]  # a system prompt every conversation starts with
    store(router, "a", system)
    chosen = [router.route(system + prompt(200 + i, 8 * BLOCK), now=0.0) for i in range(3)]
    assert [d.reason for d in chosen] == ["no_prefix"] * 3  # 2 of 10 blocks < 50%
    assert sorted(d.replica for d in chosen) == ["a", "b", "c"]  # spread, not piled onto "a"


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="policy must be one of"):
        RoutingPolicyConfig(policy="random")
    with pytest.raises(ValueError, match="gate_ratio"):
        RoutingPolicyConfig(gate_ratio=0.5)
    with pytest.raises(ValueError, match="block size 16 != block_tokens 32"):
        Router(32, hasher=HASHER)
    with pytest.raises(RoutingError, match="no hasher"):
        Router(BLOCK).route([1, 2, 3])
