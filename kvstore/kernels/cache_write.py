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


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton launcher of ``kernels.store_kv``."""
    _checks.check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    _checks.check_launchable(_store_kv_kernel, key.device)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    with _checks.device_guard(key.device):
        _store_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            *k_cache.stride()[:3], *v_cache.stride()[:3],
            NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, num_warps=4,
        )  # fmt: skip
