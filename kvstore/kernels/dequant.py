"""Dequantize 8-bit rows that share one scale per row, in Triton (the int8 and fp8 codecs' decode).

``out[b, r, :] = data[b, r, :] * scales[b, r]``, computed in float32 and rounded once to
``out``'s dtype; ``data`` is int8, or float8 e4m3fn read as bytes (its bits moved into
float16's, which gives the value times 2**-8 exactly, as kernels.reference does). A GPU that
fetches encoded blocks uploads the encoded bytes (half the traffic) and runs this on views of
them: ``data`` and ``scales`` are strided views into the encoded rows (docs/storage-format.md),
``out`` the device blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.kernels import _checks

_TILE = 4096  # elements per program


@triton.jit
def _dequantize_kernel(
    data_ptr, scales_ptr, out_ptr, num_rows,
    stride_db, stride_dr, stride_sb, stride_sr, stride_ob, stride_or,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, ROWS: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_mask = rows < num_rows
    mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
    q = tl.load(data_ptr + b * stride_db + rows[:, None] * stride_dr + dims[None, :], mask=mask, other=0)
    s = tl.load(scales_ptr + b * stride_sb + rows * stride_sr, mask=row_mask, other=0.0)
    if FP8:  # e4m3fn byte -> float16 bits s << 15 | (e & 0x7f) << 7: the value times 2**-8
        u = q.to(tl.int32) & 0xFF
        half = (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
        values = half.to(tl.float32) * (s.to(tl.float32) * 256.0)[:, None]
    else:
        values = q.to(tl.float32) * s.to(tl.float32)[:, None]
    out_ptrs = out_ptr + b * stride_ob + rows[:, None] * stride_or + dims[None, :]
    tl.store(out_ptrs, values.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_int8(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Triton launcher of ``kernels.dequantize_int8``."""
    _checks.check_dequantize_int8(data, scales, out)
    return _launch(data, scales, out, fp8=False)


def dequantize_fp8(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Triton launcher of ``kernels.dequantize_fp8``."""
    _checks.check_dequantize_fp8(data, scales, out)
    return _launch(data.view(torch.uint8), scales, out, fp8=True)


def _launch(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, fp8: bool) -> torch.Tensor:
    _checks.check_launchable(_dequantize_kernel, out.device)
    n, num_rows, head_dim = data.shape
    if n == 0 or num_rows == 0 or head_dim == 0:
        return out
    head_dim_pad = triton.next_power_of_2(head_dim)
    rows = max(1, _TILE // head_dim_pad)
    num_tiles = triton.cdiv(num_rows, rows)
    if num_tiles > 65535:  # CUDA's limit on the second grid axis
        raise ValueError(f"{num_rows} rows of {head_dim} need {num_tiles} tiles per block; at most 65535")
    with _checks.device_guard(out.device):
        _dequantize_kernel[(n, num_tiles)](
            data, scales, out, num_rows,
            data.stride(0), data.stride(1), scales.stride(0), scales.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, ROWS=rows, FP8=fp8, num_warps=4,
        )  # fmt: skip
    return out
