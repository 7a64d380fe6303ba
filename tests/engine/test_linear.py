"""kvstore/engine/model.py's Linear (the weight kept transposed) gives F.linear's result for every row
count, with and without a bias."""

import pytest
import torch
import torch.nn.functional as F

from kvstore.engine.model import Linear


@pytest.mark.parametrize("rows", [1, 2, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    linear = Linear(w, b)
    assert linear.weight_t.shape == (64, 96) and linear.weight_t.is_contiguous()  # kept transposed
    out = linear(x)
    assert out.shape == (rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
