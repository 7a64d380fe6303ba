"""A hybrid model's KV groups in the router: the index holds every group's keys, a replica
scores its reconciled hit (every full group up to the boundary, every sliding-window group its
window ending there), the info document names the groups, and ``kvstore route`` learns them
from a replica and routes by the hit its real event stream shows."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch

from kvstore.events import EventPublisher, EventsConfig, event_groups
from kvstore.keys import BlockHasher, Namespace
from kvstore.layout import KVGroup, KVLayout
from kvstore.services.router.policy import CPU, DISK, GPU, ROUTED, Router, RoutingPolicyConfig
from kvstore.services.router.replica import parse_info

from route_helpers import BLOCK, FAKE_INFO, FakeReplica, RouterThread

WINDOW = 2 * BLOCK  # a token attends to 31 before it: cdiv(31, 16) = 2 blocks end at a boundary
HYBRID = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=BLOCK, dtype=torch.float32,
                  groups=(KVGroup("full", (0, 2)), KVGroup("sliding", (1, 3), window=WINDOW)))
HASHER = BlockHasher(Namespace("router-groups-test", HYBRID))
REPLICAS = ("a", "b", "c")
NUM_BLOCKS = 10


def make_router(**config: object) -> Router:
    router = Router(BLOCK, RoutingPolicyConfig(**config), HASHER)  # type: ignore[arg-type]
    for name in REPLICAS:
        router.add_replica(name)
    return router


def prompt(salt: int = 1, num_blocks: int = NUM_BLOCKS) -> list[int]:
    return [salt * 100_000 + i for i in range(num_blocks * BLOCK)]


def group_keys(tokens: list[int]) -> list[list[bytes]]:
    keys = HASHER.block_keys(tokens)
    return [HASHER.group_keys(keys, g) for g in range(HYBRID.num_groups)]


def store(router: Router, replica: str, group: int, blocks: range, medium: str = GPU, salt: int = 1) -> None:
    """``replica`` holds group ``group``'s blocks ``blocks`` of the prompt of ``salt``."""
    keys = group_keys(prompt(salt))[group]
    router.stored(replica, [keys[i] for i in blocks], medium)


def test_the_router_looks_every_group_up() -> None:
    router = make_router()
    assert router.windows == (None, 2) and HYBRID.group(1).window_blocks(BLOCK) == 2
    assert Router(BLOCK, hasher=BlockHasher(Namespace("plain", KVLayout(2, 2, 16, BLOCK)))).windows is None


def test_a_sliding_group_without_the_window_at_8_scores_the_shorter_hit_where_it_is() -> None:
    router = make_router()
    store(router, "a", 0, range(8))  # the full group holds 8 blocks
    store(router, "a", 1, range(5))  # the sliding group lost blocks 5-7: its window ends at 5 at most
    d = router.route(prompt(), now=0.0)
    assert (d.replica, d.reason) == ("a", "cache_hit")
    assert d.predicted_cached_tokens == 5 * BLOCK and d.predicted_by_tier == {GPU: 5}


def test_only_the_window_blocks_and_every_full_block_score_the_full_hit() -> None:
    router = make_router()
    store(router, "b", 0, range(8))
    store(router, "b", 1, range(6, 8))  # only the window ending at 8
    d = router.route(prompt(), now=0.0)
    assert d.replica == "b" and d.predicted_cached_tokens == 8 * BLOCK and d.predicted_by_tier == {GPU: 8}


def test_mixed_replicas_are_ranked_by_their_reconciled_hits() -> None:
    router = make_router()
    store(router, "a", 0, range(8))
    store(router, "a", 1, range(5))  # hit 5
    store(router, "b", 0, range(8))
    store(router, "b", 1, range(6, 8))  # hit 8
    store(router, "c", 0, range(NUM_BLOCKS))
    store(router, "c", 1, range(3, 6))  # the full group holds all 10, but no window ends past 6: hit 6
    match = router.index.match(router._ids(HASHER.block_keys(prompt())), list(REPLICAS), windows=router.windows)
    assert match.num_blocks.tolist() == [5, 8, 6]
    d = router.route(prompt(), now=0.0)
    assert (d.replica, d.predicted_cached_tokens) == ("b", 8 * BLOCK)
    # a full group alone counts for nothing: c without its sliding blocks has no hit at all
    router.removed("c", group_keys(prompt())[1], GPU)
    match = router.index.match(router._ids(HASHER.block_keys(prompt())), ["a", "c"], windows=router.windows)
    assert match.num_blocks.tolist() == [5, 0]


def test_a_hit_position_counts_in_the_slowest_tier_its_groups_are_read_from() -> None:
    router = make_router()
    store(router, "a", 0, range(8))
    store(router, "a", 1, range(6, 8), DISK)  # the window on disk: positions 6 and 7 wait for it
    store(router, "b", 0, range(6), CPU)
    store(router, "b", 1, range(4, 6), CPU)  # hit 6 from host RAM: 6 x 0.93 = 5.58 < 6 + 2 x 0.56 = 7.12
    match = router.index.match(router._ids(HASHER.block_keys(prompt())), ["a", "b"], windows=router.windows)
    assert match.tiers_of(0) == {GPU: 6, DISK: 2} and match.tiers_of(1) == {CPU: 6}
    assert match.saved_blocks.tolist() == pytest.approx([6 + 2 * 0.56, 6 * 0.93])
    assert router.route(prompt(), now=0.0).replica == "a"


def test_pending_guesses_cover_every_group() -> None:
    router = make_router()
    first = router.route(prompt(7), now=0.0)
    again = router.route(prompt(7), now=0.1)  # before any event: the router's own guess
    assert again.replica == first.replica and again.reason == "pending"
    assert again.predicted_cached_tokens == NUM_BLOCKS * BLOCK and again.predicted_by_tier == {ROUTED: NUM_BLOCKS}


def test_the_info_document_names_the_groups_and_the_router_rebuilds_them() -> None:
    ns = FAKE_INFO["namespace"] | {"model_id": "router-groups-test", "groups": [
        {"kind": "full", "layers": [0, 2], "window": None}, {"kind": "sliding", "layers": [1, 3], "window": WINDOW}]}
    info = parse_info(FAKE_INFO | {"namespace": ns})
    assert info.namespace.layout == HYBRID and info.namespace == HASHER.namespace
    assert parse_info(FAKE_INFO).namespace.layout.groups == ()  # a replica from before groups: one full group
    for bad in ([{"kind": "mamba", "layers": [0]}], [{"kind": "sliding", "layers": [1]}], [{"layers": [0]}], [3]):
        with pytest.raises(ValueError, match="malformed"):
            parse_info(FAKE_INFO | {"namespace": ns | {"groups": bad}})


# --------------------------------------------------------------------------------- kvstore route

class HybridReplica:
    """A fake replica of the hybrid model with a real KV-event publisher, whose snapshot source
    is the group blocks ``hold`` gave it (as the engine's device pool would be)."""

    def __init__(self) -> None:
        self.blocks: list[tuple[bytes, bytes | None, object]] = []
        self.pub = EventPublisher(EventsConfig("tcp://127.0.0.1:*", heartbeat_s=0.1))
        self.pub.add_source(lambda: [(GPU, BLOCK, list(self.blocks))])
        self.fake = FakeReplica()
        ns = FAKE_INFO["namespace"] | {"model_id": "router-groups-test", "groups": [
            {"kind": g.kind, "layers": list(g.layers), "window": g.window} for g in HYBRID.groups]}
        events = self.pub.info()
        self.fake.info = self.fake.info | {"namespace": ns, "kv_events": {
            k: events[k] for k in ("endpoint", "replay_endpoint", "topic")}}

    def hold(self, group: int, keys: list[bytes], blocks: range) -> None:
        found = event_groups(HYBRID)[group]
        self.blocks += [(keys[i], keys[i - 1] if i else None, found) for i in blocks]

    def close(self) -> None:
        self.fake.stop()
        self.pub.close()


@pytest.fixture
def hybrid_replicas() -> Iterator[list[HybridReplica]]:
    replicas = [HybridReplica() for _ in range(2)]
    yield replicas
    for replica in replicas:
        replica.close()


def test_kvstore_route_learns_the_groups_and_routes_by_the_reconciled_hit(
        hybrid_replicas: list[HybridReplica]) -> None:
    near, far = hybrid_replicas
    keys = group_keys(prompt())
    # near: every full block and the sliding window ending at 10; far: all 10 of the full group
    # and the sliding group's first 4 (its hit is 4, however much of the full group it holds)
    near.hold(0, keys[0], range(NUM_BLOCKS))
    near.hold(1, keys[1], range(8, 10))
    far.hold(0, keys[0], range(NUM_BLOCKS))
    far.hold(1, keys[1], range(4))
    router = RouterThread([far.fake.url, near.fake.url])
    try:
        view = router.wait_for(lambda v: all(r["healthy"] and r["indexed_blocks"].get(GPU) for r in v.values()),
                               30, "both replicas indexed (by their snapshots)")
        assert view[near.fake.url]["indexed_blocks"][GPU] == 12 and view[far.fake.url]["indexed_blocks"][GPU] == 14
        groups = httpx.get(f"{router.url}/v1/router/replicas", timeout=5).json()["kv_groups"]
        assert groups == [{"kind": "full", "layers": [0, 2], "window": None},
                          {"kind": "sliding", "layers": [1, 3], "window": WINDOW}]
        reply = httpx.post(f"{router.url}/v1/completions", json={"model": "random", "prompt": prompt(),
                                                                  "max_tokens": 1}, timeout=10)
        assert reply.status_code == 200
        assert reply.headers["x-kvstore-replica"] == near.fake.url
        assert int(reply.headers["x-kvstore-predicted-cached-tokens"]) == NUM_BLOCKS * BLOCK
        assert near.fake.bodies and not far.fake.bodies
        # the live stream adds far's window ending at 10: its two blocks are indexed
        far.pub.stored(GPU, keys[1][8:], keys[1][7:9], BLOCK, group=event_groups(HYBRID)[1])
        router.wait_for(lambda v: v[far.fake.url]["indexed_blocks"][GPU] == 16, 10, "far's window indexed")
    finally:
        assert router.close() == 0
