"""The tied output projection's fast path (``tied_logits``) gives ``F.linear``'s logits at every
row count, on both sides of its switch-over, and the same greedy choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstore.engine.layers import TIED_ROWS, tied_logits


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 16, TIED_ROWS, TIED_ROWS + 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_logits_equal_f_linear(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    embed = torch.randn(1000, 64, generator=gen).to(dtype)
    hidden = torch.randn(rows, 64, generator=gen).to(dtype)
    got, want = tied_logits(hidden, embed), F.linear(hidden, embed)
    assert got.shape == want.shape == (rows, 1000) and got.dtype == dtype and got.is_contiguous()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol)
    if rows:
        # a distinct maximum per row: the argmax agrees wherever float rounding cannot flip it
        top2 = want.float().topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
        assert torch.equal(got.float().argmax(-1)[clear], want.float().argmax(-1)[clear])
