"""Quantized pages (int8 and fp8 codes with one float16 scale per token row): the quantizer's
bounds, attention over the codes against attention over their decoded values (the reference,
at odd geometries, partial blocks, GQA, one query row or many), and the Triton kernels against
the reference under ``TRITON_INTERPRET=1`` (store_kv bit for bit)."""

from __future__ import annotations

import pytest
import torch

from kvstore.kernels import packed_head_dim, page_views, reference
from kvstore.kernels.cache_write import store_kv as triton_store_kv
from kvstore.kernels.decode_attention import paged_decode_attention as triton_decode
from kvstore.kernels.prefill_attention import paged_prefill_attention as triton_prefill

from kernel_testing import DEVICE, assert_close, assert_same_bits, cu_seqlens, make_paged_kv, random_queries

CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# (code, GQA group, block_size, head_dim, kv_heads): odd head counts, a head_dim not a power of two
CASES = [
    ("int8", 1, 16, 64, 2),
    ("fp8", 3, 16, 64, 3),
    ("int8", 4, 32, 32, 1),
    ("fp8", 1, 16, 80, 2),
]
LENS = [1, 17, 64, 100, 5]


def quantize_pool(float_pool: torch.Tensor, code: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed pool holding ``float_pool``'s values quantized (NaN slots poisoned with 0xFF
    bytes: int8 -1, an e4m3fn NaN, a float16 NaN scale), and those values decoded, in float32."""
    *lead, dim = float_pool.shape
    packed = torch.full((*lead, packed_head_dim(dim)), 0xFF, dtype=torch.uint8, device=float_pool.device)
    decoded = torch.full(float_pool.shape, float("nan"), dtype=torch.float32, device=float_pool.device)
    finite = torch.isfinite(float_pool).all(dim=-1)
    codes, scales = reference.quantize_rows(float_pool[finite], code)
    row_codes, row_scales = page_views(packed.view(-1, 1, 1, packed.shape[-1]), code)
    flat = finite.flatten().nonzero().flatten()
    row_codes.view(-1, dim)[flat] = codes
    row_scales.view(-1)[flat] = scales
    decoded[finite] = reference.dequantize_rows(codes, scales)
    return packed, decoded


def views(packed: torch.Tensor, layer: int, code: torch.dtype) -> tuple[torch.Tensor, ...]:
    k_codes, k_scales = page_views(packed[:, layer, 0], code)
    v_codes, v_scales = page_views(packed[:, layer, 1], code)
    return k_codes, v_codes, k_scales, v_scales


@pytest.mark.parametrize("code", ["int8", "fp8"])
def test_quantize_rows_stays_within_half_a_step_and_scales_round_up(code: str) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn((257, 4, 64), generator=gen) * torch.logspace(-3, 3, 257)[:, None, None]
    x[7] = 0.0  # a zero row: scale 0, codes 0, decoded zeros
    codes, scales = reference.quantize_rows(x, CODES[code])
    assert scales.dtype == torch.float16 and codes.dtype == CODES[code]
    amax = x.abs().amax(dim=-1)
    qmax = reference.QMAX[CODES[code]]
    assert bool((scales.float() >= amax / qmax).all())  # rounded up: no value clips
    decoded = reference.dequantize_rows(codes, scales)
    assert bool((decoded[7] == 0).all())
    err = (decoded - x).abs()
    if code == "int8":
        assert bool((err <= scales.float()[..., None] / 2 * (1 + 1e-6)).all())
    else:  # e4m3: 3 mantissa bits, relative step 2**-3 for normals; subnormal step 2**-9 of the scale
        bound = torch.maximum(x.abs() * 2**-4, scales.float()[..., None] * 2**-10)
        assert bool((err <= bound * (1 + 1e-6)).all())
        torch.testing.assert_close(codes.float(), (x / scales.float().clamp(min=1e-30)[..., None]).to(
            torch.float8_e4m3fn).float().where(scales[..., None] > 0, 0.0))


@pytest.mark.parametrize(("code", "group", "block_size", "head_dim", "kv_heads"), CASES)
def test_reference_attention_over_codes_is_attention_over_their_values(
        code: str, group: int, block_size: int, head_dim: int, kv_heads: int) -> None:
    kv = make_paged_kv(LENS, kv_heads, head_dim, block_size, torch.float32, seed=group + head_dim)
    packed, decoded = quantize_pool(kv.pool, CODES[code])
    k_codes, v_codes, k_scales, v_scales = views(packed, 1, CODES[code])
    q = random_queries(len(LENS), kv_heads * group, head_dim, torch.float32)
    scale = head_dim**-0.5
    ours = reference.paged_decode_attention(q, k_codes, v_codes, kv.block_tables, kv.seq_lens, scale,
                                            k_scales=k_scales, v_scales=v_scales)
    theirs = reference.paged_decode_attention(q, decoded[:, 1, 0], decoded[:, 1, 1], kv.block_tables, kv.seq_lens,
                                              scale)
    assert_close(ours, theirs, f"decode {code}")
    # prefill: every sequence's last rows new (one row, several, all of it)
    q_lens = [1, 9, 64, 3, 5]
    qp = random_queries(sum(q_lens), kv_heads * group, head_dim, torch.float32, seed=5)
    cu = cu_seqlens(q_lens)
    ours = reference.paged_prefill_attention(qp, k_codes, v_codes, kv.block_tables, kv.seq_lens, cu, scale,
                                             k_scales=k_scales, v_scales=v_scales)
    theirs = reference.paged_prefill_attention(qp, decoded[:, 1, 0], decoded[:, 1, 1], kv.block_tables, kv.seq_lens,
                                               cu, scale)
    assert_close(ours, theirs, f"prefill {code}")


@pytest.mark.parametrize(("code", "group", "block_size", "head_dim", "kv_heads"), CASES)
def test_triton_attention_over_codes_matches_the_reference(
        code: str, group: int, block_size: int, head_dim: int, kv_heads: int) -> None:
    kv = make_paged_kv(LENS, kv_heads, head_dim, block_size, torch.float32, seed=2 * group + head_dim)
    packed, _ = quantize_pool(kv.pool, CODES[code])
    k_codes, v_codes, k_scales, v_scales = views(packed, 1, CODES[code])
    q = random_queries(len(LENS), kv_heads * group, head_dim, torch.float32)
    scale = head_dim**-0.5
    expected = reference.paged_decode_attention(q, k_codes, v_codes, kv.block_tables, kv.seq_lens, scale,
                                                k_scales=k_scales, v_scales=v_scales)
    for split in (False, True):
        out = triton_decode(q, k_codes, v_codes, kv.block_tables, kv.seq_lens, scale, split_k=split,
                            partition_size=64, k_scales=k_scales, v_scales=v_scales)
        assert_close(out, expected, f"triton decode {code} split={split}")
    q_lens = [1, 17, 30, 2, 5]
    qp = random_queries(sum(q_lens), kv_heads * group, head_dim, torch.float32, seed=9)
    cu = cu_seqlens(q_lens)
    expected = reference.paged_prefill_attention(qp, k_codes, v_codes, kv.block_tables, kv.seq_lens, cu, scale,
                                                 k_scales=k_scales, v_scales=v_scales)
    out = triton_prefill(qp, k_codes, v_codes, kv.block_tables, kv.seq_lens, cu, scale, max_query_len=max(q_lens),
                         block_m=16, block_n=16, k_scales=k_scales, v_scales=v_scales)
    assert_close(out, expected, f"triton prefill {code}")


@pytest.mark.parametrize("code", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_store_kv_writes_the_references_codes_and_scales_bit_for_bit(code: str, dtype: torch.dtype) -> None:
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 3, 64
    gen = torch.Generator().manual_seed(11)
    # magnitudes from 1e-4 to 1e3, a zero row, and values that land on rounding ties
    key = (torch.randn((20, kv_heads, head_dim), generator=gen) * torch.logspace(-4, 3, 20)[:, None, None]).to(dtype)
    value = torch.randn((20, kv_heads, head_dim), generator=gen).to(dtype)
    key[4] = 0.0
    value[5, 0, :8] = torch.tensor([127.0, 0.5, 1.5, -2.5, 3.5, -0.5, 63.5, 1.0])
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:20]
    slots[3] = -1  # skipped
    pools = []
    for store in (reference.store_kv, triton_store_kv):
        packed = torch.full((num_blocks, 2, 2, block_size, kv_heads, packed_head_dim(head_dim)), 0xA5,
                            dtype=torch.uint8, device=DEVICE)
        k_codes, v_codes, k_scales, v_scales = views(packed, 1, CODES[code])
        store(key.to(DEVICE), value.to(DEVICE), k_codes, v_codes, slots.to(DEVICE), k_scales=k_scales,
              v_scales=v_scales)
        pools.append(packed)
    assert_same_bits(pools[1], pools[0], f"store_kv {code} {dtype}")
    assert bool((pools[0][:, 0] == 0xA5).all())  # the other layer untouched
    k_codes, _, k_scales, _ = views(pools[0], 1, CODES[code])
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    back = reference.dequantize_rows(k_codes[blocks, offsets], k_scales[blocks, offsets])
    expected = key[keep].float()
    tolerance = expected.abs().amax(dim=-1, keepdim=True) * (1 / 127 if code == "int8" else 1 / 14)
    assert bool(((back - expected).abs() <= tolerance).all())
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert bool((pools[0][:, 1, 0].flatten(0, 1)[untouched.nonzero().flatten()] == 0xA5).all())


def test_bad_quantized_inputs_are_clear_errors() -> None:
    kv = make_paged_kv([5], 2, 64, 16, torch.float32)
    packed, _ = quantize_pool(kv.pool, torch.int8)
    k_codes, v_codes, k_scales, v_scales = views(packed, 1, torch.int8)
    q = random_queries(1, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="k_scales and v_scales go together"):
        reference.paged_decode_attention(q, k_codes, v_codes, kv.block_tables, kv.seq_lens, 0.125, k_scales=k_scales)
    with pytest.raises(ValueError, match="k_cache dtype must be one of"):
        reference.paged_decode_attention(q, k_codes, v_codes, kv.block_tables, kv.seq_lens, 0.125)  # codes, no scales
    with pytest.raises(ValueError, match="k_scales shape"):
        reference.paged_decode_attention(q, k_codes, v_codes, kv.block_tables, kv.seq_lens, 0.125,
                                         k_scales=k_scales[:, :8], v_scales=v_scales[:, :8])
    with pytest.raises(ValueError, match="a quantized page view is uint8"):
        page_views(kv.pool[:, 1, 0], torch.int8)
