"""Triton dequantize_int8 and dequantize_fp8 against the reference, bit for bit, on odd shapes
and strided views; the fp8 reference against torch's own float8 conversion."""

from __future__ import annotations

import pytest
import torch

from kvstore.kernels import reference
from kvstore.kernels.dequant import dequantize_fp8, dequantize_int8

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


def _fp8_inputs(shape: tuple[int, int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every e4m3fn byte but its NaNs (0x7f, 0xff, which no encoding holds), then random ones."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(-1)
    every = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    data[: min(len(every), data.numel())] = every[: data.numel()]
    data[(data & 0x7F) == 0x7F] = 0
    scales = torch.rand(shape[:2], generator=gen) * 0.01
    scales[0, 0] = 0
    return data.view(shape).view(torch.float8_e4m3fn).to(DEVICE), scales.to(DEVICE)


@pytest.mark.parametrize("shape", [*SHAPES, (2, 9, 32)])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_fp8_matches_reference(shape: tuple[int, int, int], out_dtype: torch.dtype) -> None:
    data, scales = _fp8_inputs(shape, seed=sum(shape))
    expected = reference.dequantize_fp8(data, scales, torch.empty(shape, dtype=out_dtype, device=DEVICE))
    out = poisoned_like(expected)
    assert dequantize_fp8(data, scales, out) is out
    assert_same_bits(out, expected, f"dequantize fp8 {shape} -> {out_dtype}")
    assert dequantize_fp8(data.view(torch.uint8), scales, poisoned_like(expected)).equal(expected)  # its bytes
    # The reference is torch's own float8 conversion times the scale, rounded once.
    exact = (data.to(torch.float64) * scales.double()[..., None]).to(out_dtype)
    assert_same_bits(expected, exact, "reference vs float64 product")


def test_fp8_bad_inputs() -> None:
    data, scales = _fp8_inputs((2, 3, 8), seed=2)
    with pytest.raises(ValueError, match="dtype"):
        dequantize_fp8(data.view(torch.int8), scales, torch.empty((2, 3, 8), device=DEVICE))
    with pytest.raises(ValueError, match="must be"):
        dequantize_fp8(data, scales[:, :1], torch.empty((2, 3, 8), device=DEVICE))
