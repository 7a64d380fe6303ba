"""KV groups in the events: the fields on the wire (as vLLM encodes them), one event per group,
a layout without groups byte for byte as before, the reconciled hit, the view per group, and
a hybrid store's tiers published through a real publisher and subscriber."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from kvstore.events import EventPublisher, EventsConfig, EventView, Subscriber, event_groups, reconciled_hits
from kvstore.events.publisher import _pack
from kvstore.events.replay_ring import snapshot_batches
from kvstore.events.store_events import StoreEvents
from kvstore.events.wire import (
    CPU,
    FULL_ATTENTION,
    FULL_GROUP,
    GPU,
    SLIDING_WINDOW,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventGroup,
    WireError,
    _decode_generic,
    decode_batch,
    encode_batch,
)
from kvstore.layout import KVGroup, KVLayout

from events_helpers import until
from factories import blocks_for, make_store

DOC = Path(__file__).resolve().parents[2] / "docs" / "kv-events.md"
K1, K2, K3 = b"\x11" * 32, b"\x22" * 32, b"\x33" * 32
SLIDING = EventGroup(1, SLIDING_WINDOW, 512)
# two layer slots a group: a full group (layers 0, 2) and a sliding-window one (layers 1, 3) of 8 tokens
HYBRID = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32,
                  groups=(KVGroup("full", (0, 2)), KVGroup("sliding", (1, 3), window=8)))
GROUPS_EXAMPLE = EventBatch(1764547200.5, [BlockStored([K1], K2, [], 16, CPU).set_group(SLIDING),
                                           BlockRemoved([K3], CPU, 1)], 0, epoch=42)


def _vllm() -> Any:
    import vllm_types

    return vllm_types


def _golden(name: str) -> bytes:
    block = re.search(rf"<!-- {name}:begin -->\n```\n(.*?)```\n<!-- {name}:end -->", DOC.read_text(), re.S)
    assert block, f"docs/kv-events.md lost its {name} example"
    return bytes.fromhex(block.group(1).replace("\n", " "))


def stored(medium: str, keys: list[bytes], parents: list[bytes | None], block_size: int = 4,
           tokens: list[int] | None = None, groups: Any = FULL_GROUP) -> tuple[Any, ...]:
    """A queue item as ``EventPublisher.stored`` makes it."""
    return ("stored", medium, keys, parents, block_size, tokens, groups)


# --------------------------------------------------------------------------------- the wire

def test_the_group_fields_are_written_as_vllm_writes_them_and_documented() -> None:
    golden = _golden("golden-groups")
    assert encode_batch(GROUPS_EXAMPLE) == golden
    assert f"{len(golden)} bytes" in DOC.read_text()
    assert decode_batch(golden) == GROUPS_EXAMPLE
    v = _vllm()
    theirs = v.KVEventBatch(ts=GROUPS_EXAMPLE.ts, data_parallel_rank=0, events=[
        v.VStored([K1], K2, [], 16, None, CPU, None, group_idx=1, kv_cache_spec_kind="sliding_window",
                  kv_cache_spec_sliding_window=512), v.VRemoved([K3], CPU, group_idx=1)])
    plain = EventBatch(GROUPS_EXAMPLE.ts, GROUPS_EXAMPLE.events, 0)
    assert encode_batch(plain) == v.msgspec.msgpack.encode(theirs)  # vLLM 0.32's bytes exactly
    got = v.msgspec.msgpack.Decoder(v.KVEventBatch).decode(golden)
    assert (got.events[0].group_idx, got.events[0].kv_cache_spec_kind,
            got.events[0].kv_cache_spec_sliding_window) == (1, "sliding_window", 512)
    assert got.events[1].group_idx == 1


def test_an_unknown_group_sends_no_group_field() -> None:
    event = BlockStored([K1], None, [], 4, CPU).set_group(None)
    fields = msgpack.unpackb(encode_batch(EventBatch(1.0, [event, BlockRemoved([K1], CPU, None)], 0)))[1]
    assert "group_idx" not in fields[0] and "kv_cache_spec_kind" not in fields[0]
    assert "group_idx" not in fields[1]
    assert event.group is None and BlockStored([K1], None, [], 4, CPU).group == FULL_GROUP


def test_the_decoder_takes_vllm_0_32_and_0_34_fields_on_its_typed_path(monkeypatch: pytest.MonkeyPatch) -> None:
    v = _vllm()
    payload = v.msgspec.msgpack.encode(v.KVEventBatch34(ts=1.0, data_parallel_rank=0, events=[
        v.VStored34([7], None, [1, 2], 2, None, GPU, None, group_idx=2, kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=64, locality="LOCAL", ownership="offload", session_id="s1",
                    lookahead_token_ids=[3, 4]),
        v.VRemoved34([7], GPU, group_idx=2, locality="REMOTE", ownership="offload")]))
    assert payload[11:14] == b"\xde\x00\x0f"  # 0.34's BlockStored has 16 entries: a map16 header
    expected = [BlockStored([7], None, [1, 2], 2, GPU, None, None, None, 2, SLIDING_WINDOW, 64, "LOCAL", "offload",
                            "s1", [3, 4]), BlockRemoved([7], GPU, 2, "REMOTE", "offload")]
    assert _decode_generic(payload).events == expected
    from kvstore.events import wire

    monkeypatch.setattr(wire, "_decode_generic", lambda payload: pytest.fail("the generic decoder ran"))
    assert decode_batch(payload).events == expected
    # what kvstore writes back of them: 0.32's fields (lookahead_token_ids is read, not written)
    back = msgpack.unpackb(encode_batch(EventBatch(1.0, expected, 0)))[1]
    assert back[0]["session_id"] == "s1" and "lookahead_token_ids" not in back[0]


@pytest.mark.parametrize("field, value", [("group_idx", "1"), ("group_idx", True), ("kv_cache_spec_kind", 3),
                                          ("kv_cache_spec_sliding_window", 1.5)])
def test_malformed_group_fields_are_wire_errors(field: str, value: object) -> None:
    raw = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [b"k"], "block_size": 4, field: value}]])
    with pytest.raises(WireError, match=field):
        decode_batch(raw)


# --------------------------------------------------------------------------------- packing

def test_a_layout_without_groups_publishes_what_it_always_did() -> None:
    """The publisher's default group and a plain layout's group pack to today's bytes exactly
    (the golden example of docs/kv-events.md, from before groups: no new field)."""
    plain = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
    assert event_groups(plain) == (FULL_GROUP,) == (EventGroup(0, FULL_ATTENTION, None),)
    golden = _golden("golden")
    for group in (FULL_GROUP, event_groups(plain)[0]):
        events = _pack([stored(GPU, [K1], [None], tokens=[1, 2, 3, 4], groups=group),
                        stored(GPU, [K2], [K1], tokens=[5, 6, 7, 8], groups=group),
                        ("removed", CPU, [K3], group)])
        assert encode_batch(EventBatch(1764547200.5, events, 0, epoch=42)) == golden


def test_blocks_of_several_groups_become_one_event_per_group() -> None:
    full, sliding = event_groups(HYBRID)
    assert (full, sliding) == (EventGroup(0, FULL_ATTENTION), EventGroup(1, SLIDING_WINDOW, 8))
    a = [bytes([i]) * 32 for i in range(1, 4)]  # group 0's keys of three blocks
    b = [bytes([i]) * 32 for i in range(11, 14)]  # group 1's
    # one call of both groups, interleaved, then the next block of each in calls of its own
    events = _pack([stored(GPU, [a[0], b[0], a[1], b[1]], [None, None, a[0], b[0]], 1, [1, 1, 2, 2],
                           [full, sliding, full, sliding]),
                    stored(GPU, [a[2]], [a[1]], 1, [3], full), stored(GPU, [b[2]], [b[1]], 1, [3], sliding),
                    ("removed", GPU, [a[0], b[0]], [full, sliding]), ("removed", GPU, [a[1]], full)])
    assert events == [BlockStored(a, None, [1, 2, 3], 1, GPU),
                      BlockStored(b, None, [1, 2, 3], 1, GPU).set_group(sliding),
                      BlockRemoved([a[0], a[1]], GPU, 0), BlockRemoved([b[0]], GPU, 1)]


def test_publisher_checks_one_group_per_key() -> None:
    with EventPublisher(EventsConfig("tcp://127.0.0.1:*", replay_endpoint="")) as pub, \
            pytest.raises(ValueError, match="1 groups for 2 keys"):
        pub.stored(CPU, [K1, K2], [None, K1], 4, groups=[FULL_GROUP])


def test_snapshots_carry_each_blocks_group() -> None:
    full, sliding = event_groups(HYBRID)
    blocks = [(K1, None, full), (K2, K1, full), (K3, None, sliding), (b"\x44" * 32, K3, None)]
    batches = snapshot_batches([(CPU, 4, blocks), (GPU, 4, [(K1, None), (K2, K1)])], epoch=1, rank=0)
    assert batches[1].events == [BlockStored([K1, K2], None, [], 4, CPU),
                                 BlockStored([K3], None, [], 4, CPU).set_group(sliding),
                                 BlockStored([b"\x44" * 32], K3, [], 4, CPU).set_group(None),
                                 BlockStored([K1, K2], None, [], 4, GPU)]  # pairs: a layout without groups


# --------------------------------------------------------------------------------- the hit

def held(*rows: str) -> np.ndarray:
    """``[groups, blocks, 1]`` from one string a group: ``x`` held, ``.`` missing."""
    return np.array([[c == "x" for c in row] for row in rows], dtype=bool)[:, :, None]


@pytest.mark.parametrize("rows, windows, hit", [
    (("xxxxxxxx",), (None,), 8),  # one full group: its leading run
    (("xxx.xxxx",), (None,), 3),
    (("xxxxxxxx", "..xx..xx"), (None, 2), 8),  # the module's drawing: the window at 8 is held
    (("xxxxxxxx", "xxxxx..."), (None, 2), 5),  # the window at 8 is gone: the longest covered boundary
    (("xxxxxx..", "xxxxxxxx"), (None, 2), 6),  # the full group bounds it
    (("xxxxxxxx", ".xxxxxx."), (None, 2), 7),
    (("xxxxxxxx", "x......."), (None, 2), 1),  # a boundary near the start needs fewer blocks
    (("xxxxxxxx", "........"), (None, 2), 0),
    (("xxxxxxxx", "........"), (None, 0), 8),  # a window of 1 token needs no block before the boundary
    (("......xx",), (2,), 8),  # a model without a full group: only the window
    (("xxxx", "x.xx", "..xx"), (None, 1, 2), 4),
    (("", ""), (None, 2), 0),
])
def test_reconciled_hit_is_the_longest_boundary_every_group_serves(rows: tuple[str, ...],
                                                                   windows: tuple[int | None, ...], hit: int) -> None:
    assert reconciled_hits(held(*rows).reshape(len(rows), len(rows[0]), 1), windows).tolist() == [hit]


def test_reconciled_hits_are_per_column() -> None:
    full = np.ones((8, 3), dtype=bool)
    sliding = np.zeros((8, 3), dtype=bool)
    sliding[6:, 0] = True  # the window at 8
    sliding[2:4, 1] = True  # the window at 4
    assert reconciled_hits(np.stack([full, sliding]), (None, 2)).tolist() == [8, 4, 0]


# --------------------------------------------------------------------------------- the view

def test_the_view_keeps_each_blocks_group() -> None:
    full, sliding = event_groups(HYBRID)
    a = [bytes([i]) * 32 for i in range(1, 5)]
    b = [bytes([i]) * 32 for i in range(11, 15)]
    view = EventView()
    view.apply(EventBatch(1.0, [BlockStored(a, None, [], 4, CPU), BlockStored(b[2:], b[1], [], 4, CPU)
                                .set_group(sliding), BlockStored([K3], None, [], 4, GPU).set_group(None)]))
    assert view.blocks(CPU) == set(a) | set(b[2:]) and view.blocks(CPU, group=1) == set(b[2:])
    assert view.blocks(CPU, group=0) == set(a) and view.blocks(GPU, group=0) == set()
    assert view.group_of(b[3]) == sliding and view.group_of(a[0]) == full and view.group_of(K3) is None
    assert view.groups() == {0: full, 1: sliding} and view.parent_of(CPU, b[2]) == b[1]
    windows = (None, sliding_blocks := HYBRID.group(1).window_blocks(4))
    assert sliding_blocks == 2
    assert view.hit_on(CPU, [a, b], windows) == 4  # the window at 4 is held
    view.apply(EventBatch(2.0, [BlockRemoved([b[3]], CPU, 1)]))
    assert view.hit_on(CPU, [a, b], windows) == 0  # no window ends where the sliding group holds one
    view.apply(EventBatch(3.0, [BlockStored([b[1]], b[0], [], 4, GPU).set_group(sliding)]))
    assert view.hit_on(CPU, [a, b], windows) == 0 and view.hit_on([CPU, GPU], [a, b], windows) == 3


# --------------------------------------------------------------------------------- a store's tiers

def test_a_hybrid_stores_tiers_publish_each_blocks_group(tmp_path: Path) -> None:
    """A real store of a hybrid layout, through a real publisher and subscriber: blocks put
    with their group carry it (kind and window too), and go down to disk with it; a block the
    store cannot name (a put without a group) and removals carry none; the snapshot a late
    subscriber takes holds what the live stream built."""
    full, sliding = event_groups(HYBRID)
    store = make_store(tmp_path, host_blocks=4, disk_blocks=16, layout=HYBRID)
    with EventPublisher(EventsConfig("tcp://127.0.0.1:*", heartbeat_s=0.1)) as pub:
        events = StoreEvents(pub, store).attach()
        assert events.groups == (full, sliding)
        with Subscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint or "") as sub:
            until(lambda: sub.stats()["snapshots"] == 1, sub)
            keys = store.block_keys(list(range(16)))  # a prompt of 4 blocks
            per_group = [store.group_keys(keys, g) for g in range(2)]
            store.put(per_group[0], blocks_for(per_group[0], HYBRID), group=0)
            store.put(per_group[1], blocks_for(per_group[1], HYBRID), group=1)  # evicts group 0's to disk
            unnamed = store.block_keys(list(range(100, 104)))
            store.put(unnamed, blocks_for(unnamed, HYBRID))
            view = sub.sink
            until(lambda: view.blocks("DISK", group=0) == set(per_group[0]), sub)
            until(lambda: set(per_group[1]) <= view.blocks("CPU", group=1) | view.blocks("DISK", group=1), sub)
            assert view.group_of(per_group[1][0]) == sliding and view.group_of(unnamed[0]) is None
            assert view.hit_on(["CPU", "DISK"], per_group, (None, 2)) == 4
            store.delete(per_group[1][2:])
            until(lambda: not set(per_group[1][2:]) & (view.blocks("CPU") | view.blocks("DISK")), sub)
            assert view.hit_on(["CPU", "DISK"], per_group, (None, 2)) == 2  # the window at 2 is all that is left
        with Subscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint or "") as late:
            until(lambda: late.stats()["snapshots"] == 1, late)
            # the same blocks; their groups as the store's view gives them (StoreEvents.held)
            assert late.sink.held() == view.held()
        events.detach()
    store.close()


def test_snapshot_and_replay_carry_the_groups(tmp_path: Path) -> None:
    """A source naming its blocks' groups: a subscriber's snapshot has them, and batches it
    missed while paused come back by replay with their group fields."""
    full, sliding = event_groups(HYBRID)
    a = [bytes([i]) * 32 for i in range(1, 5)]
    b = [bytes([i]) * 32 for i in range(11, 15)]
    held: list[Any] = [(a[0], None, full), (a[1], a[0], full), (b[1], b[0], sliding)]
    with EventPublisher(EventsConfig("tcp://127.0.0.1:*", heartbeat_s=0.1)) as pub:
        pub.add_source(lambda: [(GPU, 4, list(held))])
        with Subscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint or "") as sub:
            until(lambda: sub.stats()["snapshots"] == 1, sub)
            assert sub.sink.blocks(GPU, group=0) == set(a[:2]) and sub.sink.blocks(GPU, group=1) == {b[1]}
            assert sub.sink.group_of(b[1]) == sliding
            sub.pause()
            pub.stored(GPU, [a[2], b[2]], [a[1], b[1]], 4, list(range(8)), groups=[full, sliding])
            pub.removed(GPU, [b[1]], group=sliding)
            until(lambda: pub.stats()["queued"] == 0, sub)
            sub.resume()
            until(lambda: sub.sink.blocks(GPU, group=1) == {b[2]}, sub)
            assert sub.stats()["replays"] >= 1 and sub.stats()["snapshots"] == 1
            assert sub.sink.blocks(GPU, group=0) == set(a[:3]) and sub.sink.hit_on(GPU, [a, b], (None, 2)) == 0


def test_a_layout_of_one_sliding_group_names_it_on_every_block(tmp_path: Path) -> None:
    """Mistral's layout (every layer slides): one group, so every block the store publishes is of
    it, named or not, snapshots included."""
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32,
                      groups=(KVGroup("sliding", (0, 1), window=16),))
    (only,) = event_groups(layout)
    assert only == EventGroup(0, SLIDING_WINDOW, 16)
    store = make_store(tmp_path, host_blocks=8, layout=layout)
    keys = store.block_keys(list(range(8)))
    store.put(keys, blocks_for(keys, layout))  # no group named
    with EventPublisher(EventsConfig("tcp://127.0.0.1:*", heartbeat_s=0.1)) as pub:
        events = StoreEvents(pub, store).attach()
        assert events.held() == [(CPU, 4, [(keys[0], None, only), (keys[1], keys[0], only)])]
        with Subscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint or "") as sub:
            until(lambda: sub.stats()["snapshots"] == 1, sub)
            more = store.block_keys(list(range(8, 12)))
            store.put(more, blocks_for(more, layout))
            until(lambda: sub.sink.blocks(CPU, group=0) == {*keys, *more}, sub)
            assert {sub.sink.group_of(k) for k in (*keys, *more)} == {only}
        events.detach()
    store.close()
