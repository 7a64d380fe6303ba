"""kvstore/engine/layers.py's Linear gives F.linear's result for every row count, with and without
a bias: the weight kept transposed (plain products), or prepacked in oneDNN's blocked layout."""

import pytest
import torch
import torch.nn.functional as F

from kvstore.engine.layers import Linear, can_prepack

CPU = torch.device("cpu")


@pytest.mark.parametrize("rows", [0, 1, 2, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    linear = Linear(w, b)
    assert linear.weight_t is not None and linear.packed is None
    assert linear.weight_t.shape == (64, 96) and linear.weight_t.is_contiguous()  # kept transposed
    out = linear(x)
    assert out.shape == (rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64, 65, 300])  # below, at and above the packing's row hint
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_matches_f_linear(rows: int, bias: bool) -> None:
    assert can_prepack(CPU, torch.float32)  # torch's CPU builds for x86 and arm64 carry oneDNN
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    linear = Linear(w, b, prepack=True)
    assert linear.weight_t is None and linear.packed is not None  # no second copy of the weight
    with torch.inference_mode():  # as the engine's forward calls it
        out = linear(x)
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(linear(x[:1]), out[:1], atol=1e-5, rtol=1e-5)  # a row alone, as in a batch


def test_bfloat16_is_prepacked_only_where_the_cpu_has_native_bf16() -> None:
    assert can_prepack(CPU, torch.bfloat16) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert not can_prepack(CPU, torch.float16)  # no oneDNN half products on most CPUs: plain ones
    if can_prepack(CPU, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(16, 64, generator=g), torch.randn(96, 64, generator=g)
        out = Linear(w.bfloat16(), None, prepack=True)(x.bfloat16())
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), F.linear(x.bfloat16(), w.bfloat16()).float(), atol=0.1, rtol=0.02)
