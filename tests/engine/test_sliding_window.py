"""The window is transformers': the rows and masks the engine's read plans build for a sliding
layer (kvstore/engine/read_plan.py) are exactly the keys transformers 5.25's sliding-window mask
function lets each query see (``p - W < q <= p``), for decode rows and prefill chunks with and
without context; and which layers slide is transformers' rule for each model type."""

from __future__ import annotations

import pytest
import torch

from kvstore.engine.checkpoint import ModelConfig
from kvstore.engine.read_plan import ReadPlan

BS = 4  # block size; block table [0, 1, 2, ...] and rows_per_block == BS: row id == position
CPU = torch.device("cpu")


def transformers_visible(window: int, at: int, length: int) -> set[int]:
    from transformers.masking_utils import sliding_window_causal_mask_function

    mask = sliding_window_causal_mask_function(window)
    return {kv for kv in range(length) if bool(mask(0, 0, torch.tensor(at), torch.tensor(kv)))}


@pytest.mark.parametrize("window", [1, 3, 4, 8, 13, 64])
@pytest.mark.parametrize("length", [1, 5, 8, 30])
def test_a_decode_row_reads_the_keys_transformers_shows_it(window: int, length: int) -> None:
    table = list(range(-(-length // BS)))
    plan = ReadPlan([table], [length], [], [], BS, BS, CPU, window=window)
    (part,) = plan.decode_parts
    assert set(part.rows.tolist()) == transformers_visible(window, length - 1, length)
    assert part.length == min(window, length)  # nothing read beyond the window


@pytest.mark.parametrize("window", [1, 3, 8, 13])
@pytest.mark.parametrize(("context", "num_new"), [(0, 5), (0, 20), (7, 1), (9, 6), (30, 11)])
def test_a_prefill_chunk_sees_the_keys_transformers_shows_it(window: int, context: int, num_new: int) -> None:
    length = context + num_new
    table = list(range(-(-length // BS)))
    plan = ReadPlan([], [], [], [(table, length, num_new)], BS, BS, CPU, window=window)
    ((rows, mask, _),) = plan.prefill
    # rows None: the chunk's own new rows (positions context ...); no mask: causal over them
    positions = list(range(context, length)) if rows is None else rows.tolist()
    for r in range(num_new):
        if mask is None:
            seen = {p for p in positions if p <= context + r}
        else:
            seen = {p for p, bias in zip(positions, mask[r].tolist(), strict=True) if bias == 0.0}
        assert seen == transformers_visible(window, context + r, length), (r, seen)
    assert rows is None or int(rows.min()) == max(0, context - window + 1)  # nothing below the first row's window


def test_which_layers_slide_is_transformers_rule() -> None:
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    for config in (
        Qwen2Config(**small, num_hidden_layers=6, use_sliding_window=True, sliding_window=16, max_window_layers=4),
        Qwen2Config(**small, num_hidden_layers=3, use_sliding_window=False, sliding_window=16),
        Gemma3TextConfig(**small, num_hidden_layers=18, head_dim=16, sliding_window=16),
        Gemma3TextConfig(**small, num_hidden_layers=26, head_dim=16, sliding_window=32),
    ):
        ours = ModelConfig.from_hf(config.to_dict())
        want = [config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types]
        assert [s.window for s in ours.layer_specs] == want, config.model_type
    mistral = ModelConfig.from_hf(MistralConfig(**small, num_hidden_layers=3, sliding_window=24).to_dict())
    assert [s.window for s in mistral.layer_specs] == [24, 24, 24]
    assert ModelConfig.from_hf(MistralConfig(**small, num_hidden_layers=3, sliding_window=None).to_dict()).attention == ()


@pytest.mark.parametrize(("window", "n"), [(1, 2), (1, 65), (5, 63), (5, 200), (64, 65), (64, 333), (100, 200),
                                           (300, 333), (13, 129)])
def test_a_long_chunk_attends_its_band_in_tiles_as_in_one_call(window: int, n: int) -> None:
    # A chunk longer than its window (no context) attends through banded
    # (kvstore/engine/attention.py), which slices the plan's band mask per tile of query rows:
    # the result is the one masked call's, wherever the tiles and the window fall.
    from kvstore.engine.attention import banded

    table = list(range(-(-n // BS)))
    plan = ReadPlan([], [], [], [(table, n, n)], BS, BS, CPU, window=window)
    ((rows, mask, _),) = plan.prefill
    assert rows is None and mask is not None
    gen = torch.Generator().manual_seed(n * 1000 + window)
    q = torch.randn(1, 4, n, 16, generator=gen)
    k, v = torch.randn(1, 2, n, 16, generator=gen), torch.randn(1, 2, n, 16, generator=gen)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(banded(q, k, v, mask, window, 0.25, True), want, rtol=1e-5, atol=1e-6)
