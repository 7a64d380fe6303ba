"""Triton dequantize_int8 against the reference, bit for bit, on odd shapes and strided views."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.dequant import dequantize_int8

from kernel_testing import DEVICE, assert_same_bits, poisoned_like

# (n, rows, head_dim): odd rows, a head_dim that is not a power of two, one row, one element.
SHAPES = [(3, 37, 24), (1, 1, 1), (2, 130, 64), (4, 5, 7)]
# Triton 3.9's interpreter truncates float32 -> bfloat16 casts instead of rounding them.
BF16_CAST_NEEDS_GPU = pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton's interpreter truncates bf16 casts")
OUT_DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=BF16_CAST_NEEDS_GPU)]


def _inputs(shape: tuple[int, int, int], scale_dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
    scales = (torch.rand(shape[:2], generator=gen) * 0.1).to(scale_dtype)
    scales[0, 0] = 0  # a zero row
    return data.to(DEVICE), scales.to(DEVICE)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_matches_reference(shape: tuple[int, int, int], scale_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    data, scales = _inputs(shape, scale_dtype, seed=sum(shape))
    expected = reference.dequantize_int8(data, scales, torch.empty(shape, dtype=out_dtype, device=DEVICE))
    out = poisoned_like(expected)
    assert dequantize_int8(data, scales, out) is out
    assert_same_bits(out, expected, f"dequantize {shape} {scale_dtype} -> {out_dtype}")
    # The reference is the exact product rounded once.
    exact = (data.double() * scales.double()[..., None]).to(out_dtype)
    assert_same_bits(expected, exact, "reference vs float64 product")


def test_strided_views_of_encoded_rows() -> None:
    # Rows laid out like encoded blocks in 4 KiB slots: scales then data inside each slot.
    n, rows, head_dim, slot = 3, 10, 16, 4096
    gen = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (n, slot), dtype=torch.uint8, generator=gen).to(DEVICE)
    scales = raw[:, 32 : 32 + 4 * rows].view(torch.float32).view(n, rows)
    scales.copy_(torch.rand((n, rows), generator=gen).to(DEVICE))
    data = raw[:, 128 : 128 + rows * head_dim].view(torch.int8).view(n, rows, head_dim)
    assert data.stride() == (slot, head_dim, 1) and not data.is_contiguous()
    pool = torch.full((n + 2, rows, head_dim), float("nan"), dtype=torch.float16, device=DEVICE)
    out = pool[1 : 1 + n]
    dequantize_int8(data, scales, out)
    expected = reference.dequantize_int8(data.contiguous(), scales.contiguous(),
                                         torch.empty(out.shape, dtype=out.dtype, device=DEVICE))
    assert_same_bits(out, expected, "strided")
    assert bool(pool[0].isnan().all()) and bool(pool[-1].isnan().all()), "wrote outside out"


def test_empty_and_bad_inputs() -> None:
    data, scales = _inputs((2, 3, 8), torch.float16, seed=1)
    dequantize_int8(data[:0], scales[:0], torch.empty((0, 3, 8), device=DEVICE))
    with pytest.raises(ValueError, match="must be"):
        dequantize_int8(data, scales[:, :2], torch.empty((2, 3, 8), device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        dequantize_int8(data.to(torch.int16), scales, torch.empty((2, 3, 8), device=DEVICE))
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        dequantize_int8(data, scales, torch.empty((2, 8, 3), device=DEVICE).transpose(1, 2))
