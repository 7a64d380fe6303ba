"""Factories and comparison helpers for the kernel tests, and the Triton interpreter switch.

Without a GPU the Triton kernels run on CPU through Triton's interpreter. Its flag is read when
``@triton.jit`` decorates a kernel, i.e. when a kernel module is imported; tests/conftest.py sets
it before any test module is imported. Imported on its own, this module sets it too, and reloads
a kernel module that was imported earlier without it.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_MODULES = (
    "kvstore.kernels.decode_attention",
    "kvstore.kernels.prefill_attention",
    "kvstore.kernels.cache_write",
    "kvstore.kernels.block_copy",
    "kvstore.kernels.dequant",
)

if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in TRITON_MODULES:
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

# Triton 3.9's interpreter feeds bf16 operands to tl.dot as raw 16-bit integers (products come
# out near 1e10), so bf16 kernels are checked on a GPU only.
BF16_NEEDS_GPU = pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton's interpreter mis-multiplies bf16")

# Absolute / relative tolerance of a kernel against the float32 reference, per storage dtype.
# fp16/bf16 kernels round the softmax weights to the storage dtype before P @ V.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (2e-3, 1e-2),
    torch.bfloat16: (1.5e-2, 2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str, show: int = 5) -> None:
    """Compare with the dtype's tolerance; on failure list the first mismatching elements."""
    atol, rtol = TOLERANCES.get(expected.dtype, (0.0, 0.0))
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    bad = ~((a - e).abs() <= atol + rtol * e.abs())  # NaN anywhere counts as a mismatch
    if bool(bad.any()):
        where = bad.nonzero()[:show].tolist()
        lines = [f"  {tuple(i)}: got {a[tuple(i)].item():.6g}, want {e[tuple(i)].item():.6g}" for i in where]
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.numel()} elements differ (atol {atol}, rtol {rtol}); "
            "first:\n" + "\n".join(lines)
        )


@dataclass
class PagedKV:
    """A poisoned pool holding some sequences' K/V in one layer, and their block tables."""

    pool: torch.Tensor  # [num_blocks, layers, 2, block_size, kv_heads, head_dim]
    k_cache: torch.Tensor  # pool[:, layer, 0]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded past each sequence's blocks
    seq_lens: torch.Tensor  # [num_seqs] int32


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    num_layers: int = 2,
    layer: int = 1,
) -> PagedKV:
    """Random K/V for each sequence in shuffled, non-contiguous blocks of one layer.

    Everything a correct kernel must not read is NaN: unused blocks, other layers and the slots
    past each sequence's last token. Table entries past a sequence's blocks are -1 or a huge id.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_used = sum(blocks_per_seq)
    num_blocks = 2 * num_used + 3  # spare blocks, so ids are scattered rather than 0..n-1
    pool = torch.full((num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    ids = torch.randperm(num_blocks, generator=gen)[:num_used].tolist()
    max_blocks = max(blocks_per_seq, default=0) + 2
    tables = torch.empty((len(seq_lens), max_blocks), dtype=torch.int32)
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        mine, ids = ids[:nb], ids[nb:]
        tables[i] = -1 if i % 2 else 2**30
        tables[i, :nb] = torch.tensor(mine, dtype=torch.int32)
        for pos in range(0, n, block_size):
            rows = min(block_size, n - pos)
            kv = torch.randn((2, rows, num_kv_heads, head_dim), generator=gen)
            pool[mine[pos // block_size], layer, :, :rows] = kv.to(dtype)
    pool = pool.to(DEVICE)
    return PagedKV(
        pool=pool,
        k_cache=pool[:, layer, 0],
        v_cache=pool[:, layer, 1],
        block_tables=tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
    )


def random_queries(rows: int, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((rows, num_heads, head_dim), generator=gen).to(dtype).to(DEVICE)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def cu_seqlens(q_lens: list[int]) -> torch.Tensor:
    offsets = [0]
    for n in q_lens:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=DEVICE)


def poison_below(kv: PagedKV, starts: list[int]) -> None:
    """NaN over each sequence's positions below ``starts[i]`` (what a sliding window never sees:
    a kernel that reads them, masked or not, turns its output NaN)."""
    block_size = kv.k_cache.shape[1]
    for seq, start in enumerate(starts):
        for pos in range(start):
            block = int(kv.block_tables[seq, pos // block_size])
            kv.k_cache[block, pos % block_size] = float("nan")
            kv.v_cache[block, pos % block_size] = float("nan")


def dense_attention(
    q: torch.Tensor, kv: PagedKV, seq: int, first_pos: int, scale: float, window: int | None = None
) -> torch.Tensor:
    """Naive attention of ``q`` ``[rows, heads, dim]`` (row r at position first_pos + r) for one
    sequence: gather its K/V token by token, then softmax over the visible positions (with a
    window W, the last W up to the row's own: ``p - W < q <= p``)."""
    block_size = kv.k_cache.shape[1]
    n = int(kv.seq_lens[seq])
    blocks = [int(kv.block_tables[seq, p // block_size]) for p in range(n)]
    keys = torch.stack([kv.k_cache[b, p % block_size] for p, b in enumerate(blocks)]).float()
    values = torch.stack([kv.v_cache[b, p % block_size] for p, b in enumerate(blocks)]).float()
    group = q.shape[1] // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for r in range(q.shape[0]):
        visible = first_pos + r + 1
        lo = 0 if window is None else max(0, visible - window)
        for h in range(q.shape[1]):
            k, v = keys[lo:visible, h // group], values[lo:visible, h // group]
            weights = torch.softmax((k @ q[r, h].float()) * scale, dim=0)
            out[r, h] = weights @ v
    return out.to(q.dtype)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Exact equality, bit for bit (copies must also carry NaN payloads through)."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().cpu().contiguous().view(torch.uint8).flatten()
    e = expected.detach().cpu().contiguous().view(torch.uint8).flatten()
    bad = (a != e).nonzero().flatten()
    if bad.numel():
        item = actual.element_size()
        first = sorted({int(i) // item for i in bad[:20]})[:5]
        raise AssertionError(f"{name}: {bad.numel()} bytes differ; first elements (flat index): {first}")
