"""The engine's KV groups (kvstore/engine/groups.py): a device block to and from per-group
blocks, what a hit at a boundary needs, and the longest boundary every group can serve."""

from __future__ import annotations

import pytest
import torch

from kvstore.engine.groups import DeviceGroups
from kvstore.layout import KVLayout, group_layers

# 6 layers, a full one after every two sliding ones (window 9 tokens: 2 blocks of 4 before a boundary)
KINDS = [("sliding", 9), ("sliding", 9), ("full", None)] * 2
SLOTS, GROUPS = group_layers(KINDS)
LAYOUT = KVLayout(SLOTS, 1, 4, 4, torch.float32, groups=GROUPS)


def test_groups_of_this_model() -> None:
    assert [(g.kind, g.layers) for g in GROUPS] == [("sliding", (0, 3)), ("sliding", (1, 4)), ("full", (2, 5))]
    groups = DeviceGroups(LAYOUT, 6)
    assert groups.windows == [2, 2, None] and not groups.trivial
    assert groups.needs(10, 9) == 0b111 and groups.needs(10, 8) == 0b111 and groups.needs(10, 7) == 0b100


def present_from(holes: dict[int, set[int]], upto: int):  # type: ignore[no-untyped-def]
    return lambda g, i: i < upto and i not in holes.get(g, set())


@pytest.mark.parametrize(("holes", "upto", "n_max", "expected"), [
    ({}, 10, 10, 10),  # everything there
    ({}, 6, 10, 6),  # the full group ends at 6
    ({2: {4}}, 10, 10, 4),  # a full group's hole cuts the run
    ({0: {9}}, 10, 10, 9),  # the window at 10 lacks block 9: the hit ends at 9 (window 7, 8)
    ({0: {8}, 1: {9}}, 10, 10, 8),  # each group's last hole before 10; at 8 both windows hold
    ({0: {3, 4, 5, 6, 7, 8, 9}}, 10, 10, 3),  # below the window everything is needed again
    ({0: set(range(10))}, 10, 10, 0),  # a sliding group with nothing: no hit at all
    ({0: {0, 1, 2}}, 10, 10, 10),  # blocks below the window of 10 are not needed
])
def test_the_hit_is_the_longest_boundary_every_group_serves(holes: dict[int, set[int]], upto: int, n_max: int,
                                                             expected: int) -> None:
    groups = DeviceGroups(LAYOUT, 6)
    n = groups.reconcile(n_max, present_from(holes, upto))
    assert n == expected
    present = present_from(holes, upto)
    if n:  # never a false hit: every block the boundary needs is there
        assert all(present(g, i) for i in range(n) for g in range(3) if groups.needs(n, i) >> g & 1)


def test_a_device_block_splits_into_group_blocks_and_back() -> None:
    groups = DeviceGroups(LAYOUT, 6)
    pool = torch.randn(8, 6, 2, 4, 1, 4)
    out = torch.zeros_like(pool)
    for g in range(3):
        blocks = groups.gather(pool, [5, 2], g)
        assert blocks.shape == (2, *LAYOUT.block_shape)
        assert torch.equal(blocks[:, 1], pool[[5, 2]][:, GROUPS[g].layers[1]])
        groups.scatter(out, [1, 7], g, blocks)
    assert torch.equal(out[[1, 7]], pool[[5, 2]])


def test_a_padded_group_leaves_its_last_slots_zero() -> None:
    slots, groups_ = group_layers([("sliding", 8)] * 3 + [("full", None)] * 2)  # groups of 2: (0, 2), (1,), ...
    layout = KVLayout(slots, 1, 4, 4, torch.float32, groups=groups_)
    groups = DeviceGroups(layout, 5)
    padded = next(g for g, group in enumerate(groups_) if len(group.layers) < slots)
    pool = torch.randn(3, 5, 2, 4, 1, 4)
    blocks = groups.gather(pool, [0], padded)
    assert torch.equal(blocks[0, 0], pool[0, groups_[padded].layers[0]]) and not blocks[0, 1:].any()


def test_one_group_of_every_layer_is_todays_block() -> None:
    groups = DeviceGroups(KVLayout(6, 1, 4, 4, torch.float32), 6)
    pool = torch.randn(4, 6, 2, 4, 1, 4)
    assert groups.trivial and groups.num_groups == 1 and groups.reconcile(5, lambda g, i: i < 3) == 3
    assert torch.equal(groups.gather(pool, [3, 0], 0), pool[[3, 0]])
