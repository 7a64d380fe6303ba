"""Quantized pages: how a pool of codes and scales is laid out, so that the attention kernels
read it in place.

A quantized pool is a uint8 tensor ``[num_blocks, layers, 2, block_size, kv_heads, head_dim + 2]``:
each (token, head) row holds its ``head_dim`` one-byte codes (int8, or float8_e4m3fn) and then
its float16 scale, so one block is one contiguous payload (the store moves it as it is) and one
token's K or V row is ``kv_heads * (head_dim + 2)`` bytes::

    row of a head:  | code 0 | code 1 | ... | code head_dim-1 | scale (float16, 2 bytes) |

``page_views`` splits one layer's K or V view of such a pool into the codes and the scales that
the kernels take (``k_cache``/``k_scales``): strided views, no copy.
"""

from __future__ import annotations

import torch

PAGE_CODES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALE_DTYPE = torch.float16
SCALE_BYTES = 2


def packed_head_dim(head_dim: int) -> int:
    """Bytes of one (token, head) row of a quantized page: the codes and their scale."""
    return head_dim + SCALE_BYTES


def page_views(packed: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[num_blocks, block_size, kv_heads, head_dim]`` and scales ``[num_blocks,
    block_size, kv_heads]`` viewing one layer's K or V of a quantized pool (``packed``: uint8
    ``[num_blocks, block_size, kv_heads, head_dim + 2]``, head rows contiguous).

    Raises:
        ValueError: ``packed`` is not such a view.
    """
    if packed.dtype != torch.uint8 or packed.dim() != 4 or packed.shape[-1] <= SCALE_BYTES or packed.stride(-1) != 1:
        raise ValueError(f"a quantized page view is uint8 [num_blocks, block_size, kv_heads, head_dim + 2] with "
                         f"contiguous head rows, got {packed.dtype} {tuple(packed.shape)} strides {packed.stride()}")
    if code_dtype not in PAGE_CODES.values():
        raise ValueError(f"page codes are one of {list(PAGE_CODES)}, got {code_dtype}")
    head_dim = packed.shape[-1] - SCALE_BYTES
    codes = packed[..., :head_dim].view(code_dtype)
    scales = packed[..., head_dim:].view(SCALE_DTYPE)[..., 0]
    return codes, scales


def pack_rows(x: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """Float rows ``[n, kv_heads, head_dim]`` quantized (``reference.quantize_rows``) into page
    rows: uint8 ``[n, kv_heads, head_dim + 2]``."""
    from kvstore.kernels.reference import quantize_rows

    codes, scales = quantize_rows(x, code_dtype, SCALE_DTYPE)
    n, heads, head_dim = x.shape
    out = torch.empty((n, heads, packed_head_dim(head_dim)), dtype=torch.uint8, device=x.device)
    out[..., :head_dim] = codes.view(torch.uint8)
    out[..., head_dim:] = scales.view(torch.uint8).view(n, heads, SCALE_BYTES)
    return out


def unpack_rows(rows: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """Page rows ``[..., head_dim + 2]`` (uint8, head rows contiguous) decoded: float32 ``[..., head_dim]``."""
    from kvstore.kernels.reference import dequantize_rows

    head_dim = rows.shape[-1] - SCALE_BYTES
    return dequantize_rows(rows[..., :head_dim].view(code_dtype), rows[..., head_dim:].view(SCALE_DTYPE)[..., 0])
