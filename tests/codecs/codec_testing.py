"""Real-shaped random KV for the codec tests: Gaussian values with a few outlier channels."""

from __future__ import annotations

import torch

from kvstore.layout import KVLayout


def random_kv(layout: KVLayout, n: int, seed: int = 0, outliers: float = 20.0) -> torch.Tensor:
    """``[n, *block_shape]`` blocks: N(0, 1) values, and in K a few head_dim channels scaled by
    ``outliers`` (the pattern real keys show), in the layout's dtype."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *layout.block_shape), generator=gen)
    channels = torch.randperm(layout.head_dim, generator=gen)[: max(1, layout.head_dim // 16)]
    x[:, :, 0, ..., channels] *= outliers
    return x.to(layout.dtype)


def int8_bound(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The documented per-element error bound of int8 (float16 scales) for blocks ``x``:
    amax / 254 per head row, times (1 + 2**-10) for the scale's rounding, plus 2**-25 for a
    subnormal scale, plus the output dtype's rounding of the decoded value."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    bound = amax / 254 * (1 + 2**-9) + 2**-24
    if out_dtype != torch.float32:
        finfo = torch.finfo(out_dtype)
        bound = bound + amax * finfo.eps / 2 + finfo.smallest_normal * finfo.eps
    return bound
