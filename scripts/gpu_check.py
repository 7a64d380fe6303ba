"""GPU check of the Triton kernels: correctness at real sizes, then timings against baselines.

Run ``python scripts/gpu_check.py`` on a CUDA machine (a few minutes, ~10 GiB of GPU memory). It
compares every kernel with ``kvstore.kernels.reference`` in fp16 and bf16, times each kernel and its
baseline side by side with ``triton.testing.do_bench`` (median), prints a table and rewrites the
``bench:gpu`` section of ``docs/benchmarks.md`` (``--no-write`` skips that). Exit status 1 when a
correctness check fails; without CUDA it prints "no CUDA device; nothing measured" and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere in the checkout

BENCH_MD = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- bench:gpu:start -->", "<!-- bench:gpu:end -->"
NUM_SEQS, CONTEXT, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 4096, 32, 8, 128, 16
PREFILL_SEQS, PREFILL_NEW = 8, 1024  # prefill: 8 sequences, 1024 new rows after a 3072-token prefix
COPY_LAYERS, COPY_POOL_BLOCKS, COPY_BLOCKS = 32, 1024, 256  # 2 MiB blocks; 512 MiB per transfer
TOLERANCES = {torch.float16: (2e-3, 1e-2), torch.bfloat16: (1.5e-2, 2e-2)}


def paged_setup(dtype: torch.dtype, seq_lens: list[int]) -> dict[str, torch.Tensor]:
    """A two-layer pool holding the sequences in shuffled blocks of layer 1."""
    per_seq = -(-max(seq_lens) // BLOCK_SIZE)
    num_blocks = len(seq_lens) * per_seq + 64
    pool = torch.randn((num_blocks, 2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), device="cuda").to(dtype)
    ids = torch.randperm(num_blocks, device="cuda")[: len(seq_lens) * per_seq]
    tables = ids.view(len(seq_lens), per_seq).int()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return {"pool": pool, "k": pool[:, 1, 0], "v": pool[:, 1, 1], "tables": tables, "lens": lens}


def compare(name: str, got: torch.Tensor, want: torch.Tensor, exact: bool = False) -> tuple[str, str, bool]:
    if exact:
        ok = torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return name, "bit-exact" if ok else "DIFFERS", ok
    atol, rtol = TOLERANCES[want.dtype]
    err = (got.float() - want.float()).abs()
    ok = bool((err <= atol + rtol * want.float().abs()).all())
    return name, f"max abs err {err.max().item():.2e}", ok


def correctness(dtype: torch.dtype) -> list[tuple[str, str, bool]]:
    from kvstore.kernels import block_copy, cache_write, decode_attention, prefill_attention, reference

    tag = str(dtype).removeprefix("torch.")
    lens = torch.randint(CONTEXT - 300, CONTEXT + 1, (NUM_SEQS,)).tolist()
    lens[0], lens[1] = 1, CONTEXT  # a lone token and a full table
    s = paged_setup(dtype, lens)
    q = torch.randn((NUM_SEQS, NUM_HEADS, HEAD_DIM), device="cuda").to(dtype)
    paged = (s["k"], s["v"], s["tables"], s["lens"])
    scale = HEAD_DIM**-0.5
    want = reference.paged_decode_attention(q, *paged, scale)
    results = []
    for split in (False, True, None):
        got = decode_attention.paged_decode_attention(q, *paged, scale, max_seq_len=CONTEXT, split_k=split)
        results.append(compare(f"decode {tag} split_k={split}", got, want))

    p_lens = [PREFILL_NEW + (CONTEXT - PREFILL_NEW) - 7 * i for i in range(PREFILL_SEQS)]
    p = paged_setup(dtype, p_lens)
    q_lens = [PREFILL_NEW - 13 * i for i in range(PREFILL_SEQS)]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    rows = torch.randn((sum(q_lens), NUM_HEADS, HEAD_DIM), device="cuda").to(dtype)
    p_args = (rows, p["k"], p["v"], p["tables"], p["lens"], cu, scale)
    want = reference.paged_prefill_attention(*p_args)
    results.append(compare(f"prefill {tag}", prefill_attention.paged_prefill_attention(*p_args), want))

    new = torch.randn((2, NUM_SEQS, NUM_KV_HEADS, HEAD_DIM), device="cuda").to(dtype)
    slots = torch.randperm(s["pool"].shape[0] * BLOCK_SIZE, device="cuda")[:NUM_SEQS]
    slots[::5] = -1
    expected = s["pool"].clone()
    reference.store_kv(new[0], new[1], expected[:, 1, 0], expected[:, 1, 1], slots)
    cache_write.store_kv(new[0], new[1], s["k"], s["v"], slots)
    results.append(compare(f"store_kv {tag}", s["pool"], expected, exact=True))

    ids = torch.randperm(s["pool"].shape[0])[:300]
    for where in ("device", "pinned"):
        staging = torch.empty((300, *s["pool"].shape[1:]), dtype=dtype, device="cuda" if where == "device" else "cpu")
        staging = staging.pin_memory() if where == "pinned" else staging
        block_copy.gather_blocks(s["pool"], ids, staging)
        torch.cuda.synchronize()
        results.append(compare(f"gather to {where} {tag}", staging.cuda(), s["pool"][ids.cuda()], exact=True))
        fresh = torch.randn(staging.shape).to(dtype)
        fresh = fresh.pin_memory() if where == "pinned" else fresh.cuda()
        block_copy.scatter_blocks(s["pool"], ids, fresh)
        torch.cuda.synchronize()
        results.append(compare(f"scatter from {where} {tag}", s["pool"][ids.cuda()], fresh.cuda(), exact=True))

    from kvstore.kernels import dequant

    data8 = torch.randint(-127, 128, (64, 1536, HEAD_DIM), dtype=torch.int8, device="cuda")
    fp8 = torch.randint(0, 256, data8.shape, dtype=torch.uint8, device="cuda")
    fp8[(fp8 & 0x7F) == 0x7F] = 0  # e4m3fn's NaN codes never occur in an encoding
    row_scales = torch.rand(data8.shape[:2], device="cuda") * 0.01
    for name, fn, ref, data in (("int8", dequant.dequantize_int8, reference.dequantize_int8, data8),
                                ("fp8", dequant.dequantize_fp8, reference.dequantize_fp8, fp8)):
        want = ref(data, row_scales, torch.empty(data.shape, dtype=dtype, device="cuda"))
        got = fn(data, row_scales, torch.empty(data.shape, dtype=dtype, device="cuda"))
        results.append(compare(f"dequantize {name} {tag}", got, want, exact=True))
    return results


def bench(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, return_mode="median"))


def timings() -> list[tuple[str, float, str, str, float, str]]:
    """Rows of (measurement, ms, achieved, baseline, ratio, target)."""
    from kvstore.kernels import block_copy, decode_attention, prefill_attention

    dtype = torch.float16
    rows = []
    s = paged_setup(dtype, [CONTEXT] * NUM_SEQS)
    q = torch.randn((NUM_SEQS, NUM_HEADS, HEAD_DIM), device="cuda").to(dtype)
    out = torch.empty_like(q)
    kv_bytes = 2 * NUM_SEQS * CONTEXT * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    src = torch.empty(kv_bytes // 2, dtype=dtype, device="cuda")
    dst = torch.empty_like(src)
    copy_gbs = 2 * kv_bytes / bench(lambda: dst.copy_(src)) / 1e6  # read + write traffic
    copy_label = f"D2D copy {copy_gbs:.0f} GB/s (read+write)"
    for split in (False, True, None):
        decode = functools.partial(
            decode_attention.paged_decode_attention,
            q, s["k"], s["v"], s["tables"], s["lens"], 0.088, out=out, max_seq_len=CONTEXT, split_k=split,
        )  # fmt: skip
        ms = bench(decode)
        gbs = kv_bytes / ms / 1e6
        rows.append((f"decode split_k={split}", ms, f"{gbs:.0f} GB/s", copy_label, gbs / copy_gbs, ">= 0.70"))

    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    p = paged_setup(dtype, [CONTEXT] * PREFILL_SEQS)
    rows_q = torch.randn((PREFILL_SEQS * PREFILL_NEW, NUM_HEADS, HEAD_DIM), device="cuda").to(dtype)
    cu = torch.arange(0, PREFILL_SEQS + 1, dtype=torch.int32, device="cuda") * PREFILL_NEW
    p_out = torch.empty_like(rows_q)

    # Baseline: the same KV gathered contiguous per sequence, KV heads expanded, bottom-right causal.
    def dense(cache: torch.Tensor) -> torch.Tensor:
        gathered = cache[p["tables"].long()].flatten(1, 2)  # [S, T, kvh, D]
        return gathered.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=2).transpose(1, 2).contiguous()

    k, v = dense(p["k"]), dense(p["v"])
    q_dense = rows_q.view(PREFILL_SEQS, PREFILL_NEW, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    mask = causal_lower_right(PREFILL_NEW, CONTEXT)
    sdpa_ms = bench(lambda: F.scaled_dot_product_attention(q_dense, k, v, attn_mask=mask, scale=0.088))
    flops = 4 * PREFILL_SEQS * NUM_HEADS * HEAD_DIM * PREFILL_NEW * (CONTEXT - PREFILL_NEW / 2)
    for block_m, block_n in ((64, 64), (128, 64), (128, 32)):  # the default first, then larger tiles
        prefill = functools.partial(
            prefill_attention.paged_prefill_attention,
            rows_q, p["k"], p["v"], p["tables"], p["lens"], cu, 0.088,
            out=p_out, max_query_len=PREFILL_NEW, block_m=block_m, block_n=block_n,
        )  # fmt: skip
        ms = bench(prefill)
        label = f"prefill tiles {block_m}x{block_n}"
        rows.append((label, ms, f"{flops / ms / 1e9:.0f} TFLOP/s", f"SDPA {sdpa_ms:.3f} ms", sdpa_ms / ms, ">= 1.0"))

    pool = torch.randn((COPY_POOL_BLOCKS, COPY_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), device="cuda").to(dtype)
    ids = torch.randperm(COPY_POOL_BLOCKS, device="cuda")[:COPY_BLOCKS]
    host = torch.empty((COPY_BLOCKS, *pool.shape[1:]), dtype=dtype).pin_memory()
    nbytes = host.numel() * dtype.itemsize
    contiguous = pool[:COPY_BLOCKS].clone()
    d2h = bench(lambda: host.copy_(contiguous, non_blocking=True))
    h2d = bench(lambda: contiguous.copy_(host, non_blocking=True))
    id_list = ids.tolist()

    def per_block_dma() -> None:  # what the one-launch gather replaces: one DMA per block
        for i, b in enumerate(id_list):
            host[i].copy_(pool[b], non_blocking=True)

    for name, ms, base in (
        ("gather to pinned", bench(lambda: block_copy.gather_blocks(pool, ids, host)), d2h),
        ("scatter from pinned", bench(lambda: block_copy.scatter_blocks(pool, ids, host)), h2d),
        ("(info) gather as per-block DMA", bench(per_block_dma), d2h),
    ):
        label = f"one pinned copy {nbytes / base / 1e6:.0f} GB/s"
        rows.append((name, ms, f"{nbytes / ms / 1e6:.0f} GB/s", label, base / ms, ">= 0.80" if "info" not in name else "-"))

    # The codecs' decode on the device: 128 encoded blocks of the store's bench layout (24
    # layers x K/V x 16 tokens x 2 heads = 1,536 rows of 64 per block) into fp16, against a
    # D2D copy of the fp16 output (2 bytes read + 2 written per element; decode reads 1 + 2/64).
    from kvstore.kernels import dequant

    n, rows_per_block, dim = 128, 1536, 64
    out16 = torch.empty((n, rows_per_block, dim), dtype=dtype, device="cuda")
    like = torch.empty_like(out16)
    copy_ms = bench(lambda: like.copy_(out16))
    scales = torch.rand((n, rows_per_block), device="cuda")
    for name, fn, data in (
        ("(info) dequantize int8", dequant.dequantize_int8,
         torch.randint(-127, 128, out16.shape, dtype=torch.int8, device="cuda")),
        ("(info) dequantize fp8", dequant.dequantize_fp8,
         torch.randint(0, 120, out16.shape, dtype=torch.uint8, device="cuda")),
    ):
        ms = bench(functools.partial(fn, data, scales, out16))
        gbs = out16.numel() * 2 / ms / 1e6
        rows.append((name, ms, f"{gbs:.0f} GB/s of fp16", f"D2D copy {copy_ms:.3f} ms", copy_ms / ms, "-"))
    return rows


def write_section(text: str) -> None:
    doc = BENCH_MD.read_text()
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    BENCH_MD.write_text(f"{head}{START}\n{text.rstrip()}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device; nothing measured")
        return 0
    import triton

    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    checks = [row for dtype in (torch.float16, torch.bfloat16) for row in correctness(dtype)]
    failed = [name for name, _, ok in checks if not ok]
    for name, detail, ok in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    rows = timings()
    lines = [
        "## GPU kernels (`python scripts/gpu_check.py`)",
        "",
        f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, {date.today().isoformat()}. "
        f"Correctness against `kvstore.kernels.reference` at real sizes (fp16 and bf16): "
        f"{len(checks) - len(failed)} of {len(checks)} checks passed"
        + (f"; FAILED: {', '.join(failed)}." if failed else "."),
        "",
        f"Decode: {NUM_SEQS} sequences x {CONTEXT} tokens, {NUM_HEADS} q / {NUM_KV_HEADS} KV heads, head_dim "
        f"{HEAD_DIM}, block {BLOCK_SIZE}, fp16. Prefill: {PREFILL_SEQS} x {PREFILL_NEW} new rows after "
        f"{CONTEXT - PREFILL_NEW} cached. Copies: {COPY_BLOCKS} blocks of "
        f"{COPY_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2 >> 20} MiB. Median of `do_bench`.",
        "",
        "| measurement | time (ms) | achieved | baseline | ratio | target |",
        "|---|---:|---:|---|---:|---|",
        *(f"| {n} | {ms:.3f} | {a} | {b} | {r:.2f} | {t} |" for n, ms, a, b, r, t in rows),
    ]
    print("\n".join(lines))
    if not args.no_write:
        write_section("\n".join(lines))
        print(f"wrote {BENCH_MD}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
