"""KVLayout: block geometry, byte sizes, the fingerprint text, tensor checks, field validation."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from kvstore.errors import ConfigError, LayoutMismatchError
from kvstore.layout import DTYPE_NAMES, DTYPES_BY_NAME, KVGroup, KVLayout, group_layers
from kvstore.protocol import layout_from_dict, layout_to_dict


def issue_layout(**overrides: Any) -> KVLayout:
    """The issue's example: a 24-layer model with 2 KV heads of dim 64, fp16, 16-token blocks."""
    fields: dict[str, Any] = dict(
        num_layers=24, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16
    )
    return KVLayout(**{**fields, **overrides})


def test_issue_example_block_geometry() -> None:
    layout = issue_layout()
    assert layout.block_shape == (24, 2, 16, 2, 64)
    assert layout.elements_per_block == 24 * 2 * 16 * 2 * 64 == 98304
    assert layout.bytes_per_block == 196608 == 192 * 1024
    assert layout.dtype_name == "float16"


def test_defaults_are_16_token_fp16_blocks_without_tp() -> None:
    layout = KVLayout(num_layers=24, num_kv_heads=2, head_dim=64)
    assert layout == issue_layout()
    assert (layout.block_size, layout.dtype, layout.tp_rank, layout.tp_size) == (16, torch.float16, 0, 1)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float32, 393216),
        (torch.float16, 196608),
        (torch.bfloat16, 196608),
        (torch.float8_e4m3fn, 98304),
        (torch.float8_e5m2, 98304),
        (torch.int8, 98304),
        (torch.uint8, 98304),
    ],
)
def test_bytes_per_block_per_dtype(dtype: torch.dtype, expected: int) -> None:
    layout = issue_layout(dtype=dtype)
    assert layout.bytes_per_block == expected
    assert torch.empty((1, *layout.block_shape), dtype=dtype).nbytes == expected


def test_bytes_per_block_matches_a_real_block_for_odd_shapes() -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=5, head_dim=7, block_size=11, dtype=torch.bfloat16)
    assert layout.block_shape == (3, 2, 11, 5, 7)
    assert layout.bytes_per_block == torch.zeros(layout.block_shape, dtype=torch.bfloat16).nbytes == 4620


def test_dtype_names_round_trip() -> None:
    assert set(DTYPE_NAMES.values()) == set(DTYPES_BY_NAME)
    for dtype, name in DTYPE_NAMES.items():
        assert DTYPES_BY_NAME[name] is dtype
        assert issue_layout(dtype=dtype).dtype_name == name
        # a name stands for its dtype: the same layout, the same fingerprint (keys, catalogs)
        named = issue_layout(dtype=name)  # type: ignore[arg-type]
        assert named.dtype is dtype and named == issue_layout(dtype=dtype)
        assert hash(named) == hash(issue_layout(dtype=dtype)) and named.fingerprint() == issue_layout(dtype=dtype).fingerprint()


@pytest.mark.parametrize("bad", [torch.int32, torch.float64, torch.complex64, "float64", "fp16", 16, None])
def test_an_unknown_dtype_names_the_ones_that_work(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"KVLayout.dtype must be one of \['bfloat16', 'float16'.*got " + re.escape(repr(bad))):
        issue_layout(dtype=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# The fingerprint: stable text that enters key namespaces and disk catalogs.


def test_fingerprint_exact_text() -> None:
    assert issue_layout().fingerprint() == "L24-H2-D64-B16-float16-tp0of1"
    layout = KVLayout(80, 1, 128, block_size=32, dtype=torch.float8_e4m3fn, tp_rank=7, tp_size=8)
    assert layout.fingerprint() == "L80-H1-D128-B32-float8_e4m3fn-tp7of8"


def test_fingerprint_stable_and_equal_layouts_agree() -> None:
    first, second = issue_layout(), issue_layout()
    assert first == second and hash(first) == hash(second)
    assert first.fingerprint() == second.fingerprint() == first.fingerprint()
    assert first.fingerprint().isascii()


def test_every_field_changes_the_fingerprint() -> None:
    variants = [
        issue_layout(),
        issue_layout(num_layers=25),
        issue_layout(num_kv_heads=4),
        issue_layout(head_dim=128),
        issue_layout(block_size=32),
        issue_layout(dtype=torch.bfloat16),
        issue_layout(tp_size=2),
        issue_layout(tp_rank=1, tp_size=2),
        # Digit runs that could run together if the separators were missing.
        issue_layout(num_layers=2, num_kv_heads=42),
    ]
    assert len({v.fingerprint() for v in variants}) == len(variants)


# ---------------------------------------------------------------------------------------------
# check_blocks: errors name the numbers.


def test_check_blocks_accepts_matching_tensors() -> None:
    layout = issue_layout(num_layers=2)
    blocks = torch.zeros((3, *layout.block_shape), dtype=torch.float16)
    layout.check_blocks(blocks)
    layout.check_blocks(blocks, num_blocks=3)
    layout.check_blocks(blocks[:0], num_blocks=0)


def test_check_blocks_wrong_dtype_names_both() -> None:
    layout = issue_layout(num_layers=2)
    blocks = torch.zeros((1, *layout.block_shape), dtype=torch.bfloat16)
    with pytest.raises(LayoutMismatchError, match=r"dtype torch\.bfloat16, layout wants torch\.float16"):
        layout.check_blocks(blocks)


@pytest.mark.parametrize(
    "shape",
    [
        (1, 2, 2, 16, 2, 32),  # head_dim off
        (1, 2, 2, 8, 2, 64),  # block_size off
        (1, 2, 1, 16, 2, 64),  # K only
        (2, 2, 16, 2, 64),  # one block without the leading count
        (1, 2, 2, 16, 2, 64, 1),  # an extra trailing dimension
    ],
)
def test_check_blocks_wrong_shape_names_both_shapes(shape: tuple[int, ...]) -> None:
    layout = issue_layout(num_layers=2)
    with pytest.raises(LayoutMismatchError) as info:
        layout.check_blocks(torch.zeros(shape, dtype=torch.float16))
    message = str(info.value)
    assert f"shape {shape}" in message
    assert "layout wants [n, 2, 2, 16, 2, 64]" in message


def test_check_blocks_wrong_count_names_both_counts() -> None:
    layout = issue_layout(num_layers=2)
    blocks = torch.zeros((3, *layout.block_shape), dtype=torch.float16)
    with pytest.raises(LayoutMismatchError, match="got 3 blocks for 4 keys"):
        layout.check_blocks(blocks, num_blocks=4)


def test_check_blocks_rejects_non_tensors() -> None:
    layout = issue_layout(num_layers=2)
    with pytest.raises(LayoutMismatchError, match=r"must be a torch\.Tensor, got list"):
        layout.check_blocks([[0.0]])  # type: ignore[arg-type]
    assert issubclass(LayoutMismatchError, ValueError)


# ---------------------------------------------------------------------------------------------
# Field validation.


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"])
@pytest.mark.parametrize("value", [0, -1, 1.0, "16", True, None])
def test_invalid_positive_field_raises_config_error(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"KVLayout\.{field} must be a positive int, got {value!r}"):
        issue_layout(**{field: value})


@pytest.mark.parametrize(("tp_rank", "tp_size"), [(-1, 1), (1, 1), (4, 4), (0.0, 2), ("0", 2), (None, 1)])
def test_invalid_tp_rank_raises_config_error(tp_rank: Any, tp_size: int) -> None:
    with pytest.raises(ConfigError, match=rf"KVLayout\.tp_rank must be in \[0, {tp_size}\), got {tp_rank!r}"):
        issue_layout(tp_rank=tp_rank, tp_size=tp_size)


def test_layout_is_frozen() -> None:
    layout = issue_layout()
    with pytest.raises(AttributeError):
        layout.num_layers = 2  # type: ignore[misc]


def test_bool_tp_rank_raises_config_error() -> None:
    """``tp_rank=True`` equals ``tp_rank=1`` as a dataclass but fingerprints as ``tpTrueof2``."""
    with pytest.raises(ConfigError, match="tp_rank"):
        issue_layout(tp_rank=True, tp_size=2)


# ---------------------------------------------------------------------------------------------
# KV groups.

GEMMA_270M_KINDS = [("full", None) if i % 6 == 5 else ("sliding", 512) for i in range(18)]


def test_gemma3_layers_make_five_sliding_groups_and_one_full_of_three_layers() -> None:
    slots, groups = group_layers(GEMMA_270M_KINDS)
    assert slots == 3
    assert [(g.kind, g.layers, g.window) for g in groups] == [
        ("sliding", (0, 6, 12), 512), ("sliding", (1, 7, 13), 512), ("sliding", (2, 8, 14), 512),
        ("sliding", (3, 9, 15), 512), ("sliding", (4, 10, 16), 512), ("full", (5, 11, 17), None)]
    layout = KVLayout(slots, 1, 256, 16, torch.float32, groups=groups)
    assert layout.block_shape == (3, 2, 16, 1, 256) and layout.num_groups == 6 and layout.is_hybrid
    assert layout.fingerprint().endswith("-Gs512:0,6,12/s512:1,7,13/s512:2,8,14/s512:3,9,15/s512:4,10,16/f:5,11,17")
    # the window before a boundary: 511 tokens, 32 blocks of 16
    assert groups[0].window_blocks(16) == 32 and groups[-1].window_blocks(16) is None


def test_a_model_that_attends_fully_everywhere_keeps_todays_layout() -> None:
    slots, groups = group_layers([("full", None)] * 24)
    assert (slots, groups) == (24, ())
    layout = KVLayout(slots, 2, 64, groups=groups)
    assert layout.fingerprint() == "L24-H2-D64-B16-float16-tp0of1" and layout == KVLayout(24, 2, 64)
    assert layout.num_groups == 1 and not layout.is_hybrid
    assert layout.group(0) == KVGroup("full", tuple(range(24))) and layout.kv_groups == (layout.group(0),)


def test_uneven_kinds_pad_the_last_group_and_near_even_ones_take_the_larger_count() -> None:
    qwen_like = [("full", None)] * 21 + [("sliding", 64)] * 3  # 21 full, then 3 sliding: groups of 3
    slots, groups = group_layers(qwen_like)
    assert slots == 3 and len(groups) == 8 and groups[-1] == KVGroup("sliding", (21, 22, 23), 64)
    slots, groups = group_layers([("sliding", 8)] * 13 + [("full", None)] * 11)  # 13 < 1.5 x 11: one group each
    assert slots == 13 and [len(g.layers) for g in groups] == [13, 11]
    slots, groups = group_layers([("sliding", 8)] * 7 + [("full", None)] * 2)  # 7 sliding in 4 groups of 2
    assert slots == 2 and [len(g.layers) for g in groups] == [2, 2, 2, 1, 2]


@pytest.mark.parametrize(("group", "message"), [
    (lambda: KVGroup("linear", (0,)), "kind must be one of"),
    (lambda: KVGroup("sliding", (0,)), "needs a window"),
    (lambda: KVGroup("sliding", (0,), 0), "needs a window"),
    (lambda: KVGroup("full", (0,), 8), "has no window"),
    (lambda: KVGroup("full", ()), "at least one"),
    (lambda: KVGroup("full", (-1,)), "layer indices"),
    (lambda: KVLayout(2, 1, 8, groups=(KVGroup("full", (0, 1)), KVGroup("sliding", (1,), 4))), "a layer twice"),
    (lambda: KVLayout(2, 1, 8, groups=(KVGroup("full", (0, 1, 2)),)), "more layers than a block's 2 slots"),
])
def test_bad_groups_are_config_errors(group: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        group()


def test_grouped_layouts_cross_the_wire_and_old_maps_still_load() -> None:
    slots, groups = group_layers(GEMMA_270M_KINDS)
    layout = KVLayout(slots, 1, 256, 16, torch.float32, groups=groups)
    assert layout_from_dict(layout_to_dict(layout)) == layout
    plain = KVLayout(24, 2, 64)
    assert "groups" not in layout_to_dict(plain) and layout_from_dict(layout_to_dict(plain)) == plain
    with pytest.raises(ConfigError, match="layout groups must be"):
        layout_from_dict({**layout_to_dict(plain), "groups": [["full", 3, None]]})
    with pytest.raises(ConfigError, match="keys"):
        layout_from_dict({**layout_to_dict(plain), "grups": []})
