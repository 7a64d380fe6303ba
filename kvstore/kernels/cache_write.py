"""Write new K/V rows into their paged slots for one layer, in Triton.

One program per token copies its ``[kv_heads, head_dim]`` K and V rows to
``cache[slot // block_size, slot % block_size]``. Slot -1 (a padding token) is skipped.
(Not named ``store_kv.py``: importing a submodule binds its name on the package, which would
shadow the public ``kernels.store_kv`` function.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.kernels import _checks
from kvstore.kernels._quant import encode_codes, row_scales


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)  # int64: pools may hold more than 2**31 slots
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    # A skipped token (slot -1) writes zero heads. (Folding the scalar into the head bound keeps
    # the mask a plain tensor comparison, which Triton's interpreter also accepts.)
    heads_to_write = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads < heads_to_write) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + row * stride_kct + heads * stride_kch + dims, k, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + row * stride_vct + heads * stride_vch + dims, v, mask=mask)


@triton.jit
def _store_quantized_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, slots_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QMAX: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """As ``_store_kv_kernel``, quantizing each (token, head) row: codes to the cache (int8, or
    e4m3fn bytes through an int8 view), its float16 scale beside them."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    head_ids = tl.arange(0, HEADS_PAD)
    heads = head_ids[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    heads_to_write = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    head_mask = head_ids < heads_to_write
    mask = (heads < heads_to_write) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0).to(tl.float32)
    k_scale = row_scales(k, QMAX)
    tl.store(k_cache_ptr + block * stride_kcb + row * stride_kct + heads * stride_kch + dims,
             encode_codes(k, k_scale, FP8), mask=mask)
    tl.store(k_scales_ptr + block * stride_ksb + row * stride_kst + head_ids * stride_ksh, k_scale, mask=head_mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0).to(tl.float32)
    v_scale = row_scales(v, QMAX)
    tl.store(v_cache_ptr + block * stride_vcb + row * stride_vct + heads * stride_vch + dims,
             encode_codes(v, v_scale, FP8), mask=mask)
    tl.store(v_scales_ptr + block * stride_vsb + row * stride_vst + head_ids * stride_vsh, v_scale, mask=head_mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    *, k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
) -> None:
    """Triton launcher of ``kernels.store_kv``."""
    _checks.check_store_kv(key, value, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    _checks.check_launchable(_store_kv_kernel, key.device)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if k_scales is not None and v_scales is not None:
        if k_scales.dtype != torch.float16 or v_scales.dtype != torch.float16:
            raise ValueError(f"Triton's store_kv writes float16 scales, got {k_scales.dtype} / {v_scales.dtype}")
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        with _checks.device_guard(key.device):
            _store_quantized_kernel[(num_tokens,)](
                key, value, k_cache.view(torch.int8), v_cache.view(torch.int8), k_scales, v_scales, slot_mapping,
                key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                *k_cache.stride()[:3], *v_cache.stride()[:3], *k_scales.stride(), *v_scales.stride(),
                NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
                HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
                QMAX=448.0 if fp8 else 127.0, FP8=fp8, num_warps=4,
            )  # fmt: skip
        return
    with _checks.device_guard(key.device):
        _store_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            *k_cache.stride()[:3], *v_cache.stride()[:3],
            NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, num_warps=4,
        )  # fmt: skip
