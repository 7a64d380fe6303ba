"""``kvstore bench codecs``: the codecs against same-run baselines.

In one run, on real-shaped random KV (Gaussian, with outlier channels in K): encode and
decode throughput per codec vs a plain torch copy of the same blocks (decode through the C++
kernels and through the torch path they replace); a cold read of a 2,048-token prefix with
each codec vs raw, from the disk and from a tmpfs slab (a stand-in for a drive faster than the
decode); the TTFT of that prefix from disk with int8 vs raw, through the engine; the error
figures; and byte-shuffle + zlib's ratio and speed (the lossless candidate). Results go to
stdout (and, with ``--write PATH``, to the codecs section of PATH).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvstore.codecs import get_codec
from kvstore.config import StoreConfig
from kvstore.kernels import cpu_ext
from kvstore.layout import KVLayout
from kvstore.services.common.argtypes import positive
from kvstore.store import TieredStore
from kvstore.tools.bench.harness import (
    BENCH_LAYOUT,
    drop_page_cache,
    interleaved,
    machine,
    scratch_dir,
)
from kvstore.tools.bench.output import add_output_arguments, publish

LOSSY = ("int8", "int8-fp32", "fp8", "int4-rot", "int4-norot")
READ_CODECS = ("none", "int8", "fp8", "int4-rot", "int4-norot", "auto")  # the cold-read comparison
# cold read with a codec vs raw, medians, on the disk: the issue-50 targets (int8-fp32 reads
# as int8 does); on tmpfs every codec must merely not be slower
READ_TARGETS = {"int8": 1.3, "fp8": 1.3, "int4-rot": 1.5, "int4-norot": 1.5}
# "auto" must never be slower than raw: it is raw where it chose none, so only the noise of two
# runs of one path separates them (5%, measured)
AUTO_TARGET = 0.95


@contextmanager
def torch_decode() -> Iterator[None]:
    """Decode through the torch path (``KVSTORE_KERNELS=reference``) while the block runs."""
    before = os.environ.get("KVSTORE_KERNELS")
    os.environ["KVSTORE_KERNELS"] = "reference"
    try:
        yield
    finally:
        if before is None:
            del os.environ["KVSTORE_KERNELS"]
        else:
            os.environ["KVSTORE_KERNELS"] = before


def real_shaped_kv(layout: KVLayout, n: int, seed: int = 0) -> torch.Tensor:
    """N(0, 1) blocks whose K has 1 in 16 head_dim channels 20x larger (the outliers real keys show)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *layout.block_shape), generator=gen)
    channels = torch.randperm(layout.head_dim, generator=gen)[: max(1, layout.head_dim // 16)]
    x[:, :, 0, ..., channels] *= 20.0
    return x.to(layout.dtype)


def bench_throughput(blocks: torch.Tensor, rounds: int) -> dict[str, dict[str, float]]:
    """Seconds to encode and to decode ``blocks`` per codec, and to copy them (same rounds)."""
    dst = torch.empty_like(blocks)
    dst.copy_(blocks)
    fns: list[Callable[[], object]] = [lambda: dst.copy_(blocks)]

    def on_torch(codec: Any, enc: torch.Tensor, out: torch.Tensor) -> None:
        with torch_decode():
            codec.decode(enc, out)

    for name in LOSSY:
        codec = get_codec(name)
        enc = codec.encode(blocks)
        out = torch.empty_like(blocks)
        fns.append(functools.partial(codec.encode, blocks, out=enc))
        fns.append(functools.partial(codec.decode, enc, out))
        fns.append(functools.partial(on_torch, codec, enc, out))
    times = interleaved(fns, rounds)
    result = {"copy": {"seconds": times[0]}}
    for i, name in enumerate(LOSSY):
        result[name] = {"encode": times[1 + 3 * i], "decode": times[2 + 3 * i], "decode_torch": times[3 + 3 * i],
                        "encoded_bytes": get_codec(name).encoded_bytes(BENCH_LAYOUT) * blocks.shape[0]}
    return result


def bench_shuffle_zlib(blocks: torch.Tensor) -> dict[str, float]:
    """Byte-shuffle (all low bytes, then all high bytes, per block) + zlib level 1."""
    raw = blocks.contiguous().view(torch.uint8).view(blocks.shape[0], -1, blocks.element_size())
    t0 = time.perf_counter()
    sizes = [len(zlib.compress(block.t().contiguous().numpy().tobytes(), 1)) for block in raw]
    seconds = time.perf_counter() - t0
    return {"ratio": raw.numel() / sum(sizes), "seconds": seconds, "min_ratio": raw[0].numel() / max(sizes),
            "max_ratio": raw[0].numel() / min(sizes)}


def error_figures(blocks: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per codec: max |error| / amax of its scale group, and SNR (dB) over all elements."""
    x = blocks.float()
    out: dict[str, dict[str, float]] = {}
    for name in LOSSY:
        codec = get_codec(name)
        y = codec.decode(codec.encode(blocks), torch.empty_like(blocks)).float()
        err = (y - x).abs()
        group = (3, 5) if name == "fp8" else (5,)  # fp8: per block and head; the others: per head row
        amax = x.abs().amax(dim=group, keepdim=True)
        ratio = float((err / torch.where(amax > 0, amax, 1)).max())
        snr = 10 * torch.log10(x.pow(2).sum() / err.pow(2).sum()).item()
        out[name] = {"max_err_over_amax": ratio, "snr_db": snr, "rel_err": float(err.norm() / x.norm())}
    return out


def bench_disk_read(blocks: torch.Tensor, repeat: int, workdir: Path) -> dict[str, Any]:
    """Cold get of the prefix per codec of ``READ_CODECS`` (page cache dropped before each),
    the codecs taking turns at going first; the store has read twice before, as a long-running
    one has (its staging rows and reader threads warm: a fresh store's second read of a coded
    prefix measured 1-2 ms slower than its third)."""
    layout = BENCH_LAYOUT
    n = blocks.shape[0]
    configs = {}
    keys: list[bytes] = []
    for codec in READ_CODECS:
        cfg = StoreConfig(layout=layout, model_id="bench", host_bytes=(n + 2) * layout.bytes_per_block,
                          disk_path=workdir / f"disk-{codec}", disk_bytes=(n + 2) * layout.bytes_per_block,
                          write_policy="write_through", promotion="never", disk_codec=codec)
        store = TieredStore(cfg)  # "auto" measures this disk here, once, and records its choice
        keys = store.block_keys(list(range(n * layout.block_size)))
        store.put(keys, blocks)
        store.close()
        configs[codec] = store.config  # as the store resolved it
    out = torch.empty_like(blocks)

    def cold(codec: str) -> float:
        store = TieredStore(configs[codec])  # promotion="never": the blocks stay on disk only
        for _ in range(2):  # as in a long-running store: staging rows and reader threads warm
            store.get(keys, out=out)
        drop_page_cache(Path(configs[codec].settings.disk_path) / "slab-000.bin")  # type: ignore[arg-type]
        gc.collect()  # not a full collection inside the timed read (a server freezes its heap)
        t0 = time.perf_counter()
        store.get(keys, out=out)
        elapsed = time.perf_counter() - t0
        store.close()
        return elapsed

    runs: dict[str, list[float]] = {codec: [] for codec in READ_CODECS}
    for r in range(repeat):
        order = READ_CODECS[r % len(READ_CODECS):] + READ_CODECS[: r % len(READ_CODECS)]
        for codec in order:
            runs[codec].append(cold(codec))
    slot_bytes = {c: cfg.tier_slot_bytes("disk") for c, cfg in configs.items()}
    return {"runs": runs, "slot_bytes": slot_bytes, "auto": configs["auto"].settings.disk_codec}


def tmpfs_dir() -> Path | None:
    """``/dev/shm`` where it is a writable directory (tmpfs on Linux), else None."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else None


def bench_ttft(prompt_tokens: int, repeat: int, workdir: Path) -> dict[str, Any]:
    """TTFT of a prompt whose prefix sits only on disk (page cache dropped), raw vs int8."""
    from kvstore.engine.llm import LLMEngine
    from kvstore.tools.bench.engine import BLOCK, ttft
    from kvstore.tools.bench.models import RANDOM_BENCH_MODEL as BENCH_MODEL

    prompt = torch.randint(0, int(BENCH_MODEL["vocab_size"]), (prompt_tokens,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    layout = KVLayout(num_layers=int(BENCH_MODEL["num_layers"]), num_kv_heads=int(BENCH_MODEL["num_kv_heads"]),
                      head_dim=int(BENCH_MODEL["head_dim"]), block_size=BLOCK, dtype=torch.float32)
    pool = (prompt_tokens // BLOCK + 8) * layout.bytes_per_block

    def open_store(codec: str) -> TieredStore:
        return TieredStore(StoreConfig(layout=layout, model_id="random", host_bytes=1 << 30,
                                       disk_path=workdir / f"ttft-{codec}", disk_bytes=1 << 30, disk_codec=codec))

    def engine(store: TieredStore) -> LLMEngine:
        return LLMEngine(None, random_model=BENCH_MODEL, dtype=torch.float32, block_size=BLOCK, kv_cache_bytes=pool,
                         max_num_batched_tokens=4096, fetch_policy="always", store=store)

    for codec in ("none", "int8"):  # compute once, push device -> host -> disk
        store = open_store(codec)
        llm = engine(store)
        ttft(llm, prompt)
        llm.evict_device_cache()
        llm.close()
        store.close()
    runs: dict[str, list[tuple[float, float, int]]] = {"none": [], "int8": []}
    for r in range(repeat):
        for codec in (("none", "int8") if r % 2 == 0 else ("int8", "none")):
            store = open_store(codec)
            llm = engine(store)
            drop_page_cache(workdir / f"ttft-{codec}")
            seconds, metrics = ttft(llm, prompt)
            runs[codec].append((seconds, metrics.loading_s, metrics.cached_tokens["disk"]))
            llm.close()
            store.close()
    return {codec: min(r, key=lambda x: x[0]) for codec, r in runs.items()} | {"runs": runs}


def render(tp: dict[str, Any], sz: dict[str, float], errs: dict[str, Any], reads: dict[str, dict[str, Any]],
           tt: dict[str, Any] | None, num_blocks: int, repeat: int, kernel: str) -> str:
    raw = num_blocks * BENCH_LAYOUT.bytes_per_block
    copy_s = tp["copy"]["seconds"]
    medians = {medium: {c: statistics.median(v) for c, v in r["runs"].items()} for medium, r in reads.items()}
    disk_gbps = raw / medians["disk"]["none"] / 1e9
    lines = [
        "## Codecs (`kvstore bench codecs`)",
        "",
        f"Machine: {machine()}, {torch.get_num_threads()} torch intra-op thread(s). Layout: 24 layers, 2 KV heads, "
        f"head dim 64, block 16, fp16 (192 KiB blocks); {num_blocks} blocks = a {num_blocks * 16}-token prefix of "
        f"real-shaped random KV (N(0, 1), 1 in 16 K channels 20x larger). Decode: {kernel}. Throughput: best of "
        f"{3 * repeat} interleaved rounds.",
        "",
        "| codec | bytes / block | smaller | encode | decode | decode, torch path | decode vs copy | "
        "decode (encoded bytes) vs disk read | max err / amax | SNR |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in LOSSY:
        row = tp[name]
        per_block = row["encoded_bytes"] // num_blocks
        dec_enc_gbps = row["encoded_bytes"] / row["decode"] / 1e9
        lines.append(
            f"| `{name}` | {per_block:,} | {BENCH_LAYOUT.bytes_per_block / per_block:.2f}x | "
            f"{raw / row['encode'] / 1e9:.2f} GB/s | {raw / row['decode'] / 1e9:.2f} GB/s | "
            f"{raw / row['decode_torch'] / 1e9:.2f} GB/s ({row['decode_torch'] / row['decode']:.1f}x slower) | "
            f"{copy_s / row['decode']:.2f}x | {dec_enc_gbps / disk_gbps:.1f}x | "
            f"{errs[name]['max_err_over_amax']:.5f} | {errs[name]['snr_db']:.1f} dB |")
    lines += [
        "",
        f"GB/s count raw (fp16) bytes. Baseline: `torch.Tensor.copy_` of the same blocks, "
        f"{raw / copy_s / 1e9:.2f} GB/s. Disk read: the raw cold read below (median), {disk_gbps:.2f} GB/s. "
        "int8's bound is amax/254 = 0.00394 of its row's amax (x (1 + 2^-10) for the float16 scale).",
        "",
        f"Cold read of the {num_blocks * 16}-token prefix (`TieredStore.get`, O_DIRECT, page cache dropped before "
        f"each; {repeat} rounds, the codecs taking turns at going first): medians, spread in brackets, and the "
        "speedup over raw from the same medium, median against median. `auto` (`disk_codec=\"auto\"`) "
        "measured the medium when its directory was created and stores int8 or raw blocks by that; on a "
        "medium where it chose raw its target allows the 5% two runs of one path differ by.",
        "",
        "| medium | codec | slot | cold read | vs raw | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for medium, result in reads.items():
        base = medians[medium]["none"]
        for codec in READ_CODECS:
            runs = result["runs"][codec]
            cell = f"{medians[medium][codec] * 1e3:.1f} ms ({min(runs) * 1e3:.1f}-{max(runs) * 1e3:.1f})"
            slot = f"{result['slot_bytes'][codec] // 1024} KiB"
            if codec == "none":
                lines.append(f"| {medium} | raw | {slot} | {cell} | baseline | | |")
                continue
            speedup = base / medians[medium][codec]
            if codec == "auto":
                target, name = AUTO_TARGET, f"`auto` (chose `{result['auto']}`)"
            else:
                target, name = (READ_TARGETS[codec] if medium == "disk" else 1.0), f"`{codec}`"
            lines.append(f"| {medium} | {name} | {slot} | {cell} | {speedup:.2f}x faster | >= {target:g}x | "
                         f"{'yes' if speedup >= target else 'NO'} |")
    if tt is not None:
        r8, r0 = tt["int8"], tt["none"]
        spread = {c: f"{min(x[0] for x in v) * 1e3:.0f}-{max(x[0] for x in v) * 1e3:.0f} ms"
                  for c, v in tt["runs"].items()}
        lines += [
            "",
            f"TTFT of the prefix from disk through the engine (fp32 KV, random weights), best of "
            f"{len(tt['runs']['none'])}: int8 {r8[0] * 1e3:.1f} ms (fetch {r8[1] * 1e3:.1f} ms, {r8[2]} tokens), "
            f"raw {r0[0] * 1e3:.1f} ms (fetch {r0[1] * 1e3:.1f} ms, {r0[2]} tokens): {r0[0] / r8[0]:.2f}x faster "
            f"(target: faster, {'met' if r8[0] < r0[0] else 'NOT met'}); spread int8 {spread['int8']}, "
            f"raw {spread['none']}.",
        ]
    lines += [
        "",
        f"**Lossless candidate.** Byte-shuffle + zlib (level 1) on the same blocks: {sz['ratio']:.3f}x smaller "
        f"(per block {sz['min_ratio']:.3f}-{sz['max_ratio']:.3f}x), compressing at "
        f"{raw / sz['seconds'] / 1e9:.3f} GB/s, {disk_gbps / (raw / sz['seconds'] / 1e9):.0f}x slower than the "
        "disk reads. Its size varies per block, so a fixed slot cannot turn it into capacity; it is not a codec.",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    blocks = real_shaped_kv(BENCH_LAYOUT, args.blocks)
    print("building the CPU decode kernels (once per machine) ...", flush=True)
    kernel = ("the C++ kernels (kvstore.kernels.cpu_ext)" if cpu_ext.load() is not None
              else "the torch path (the C++ kernels did not build)")
    print("encode / decode throughput ...", flush=True)
    tp = bench_throughput(blocks, 3 * args.repeat)
    print("shuffle + zlib ...", flush=True)
    sz = bench_shuffle_zlib(blocks)
    errs = error_figures(blocks)
    reads: dict[str, dict[str, Any]] = {}
    with scratch_dir(args.dir, "codecs") as tmp:
        print("disk cold reads, each codec vs raw ...", flush=True)
        reads["disk"] = bench_disk_read(blocks, args.repeat, tmp)
        shm = tmpfs_dir()
        if shm is not None:
            print("tmpfs cold reads, each codec vs raw ...", flush=True)
            with scratch_dir(str(shm), "codecs") as ram:
                reads["tmpfs"] = bench_disk_read(blocks, args.repeat, ram)
        tt = None
        if not args.no_engine:
            print("TTFT from disk through the engine, int8 vs raw ...", flush=True)
            tt = bench_ttft(args.blocks * 16, max(2, args.repeat // 2), tmp)
    text = render(tp, sz, errs, reads, tt, args.blocks, args.repeat, kernel)
    publish(args, "codecs", text)
    return 0


def register_target(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("codecs", help="codec throughput and error, cold reads per codec and TTFT vs raw")
    p.add_argument("--blocks", type=positive(int), default=128, help="blocks of the prefix (default 128 = 2,048 tokens)")
    p.add_argument("--repeat", type=positive(int), default=5, help="rounds; the best is kept (default 5)")
    p.add_argument("--dir", help="where the scratch disk tiers go (default: current directory; not tmpfs)")
    p.add_argument("--no-engine", action="store_true", help="skip the TTFT runs through the engine")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's own)")
    add_output_arguments(p)
    p.set_defaults(func=run)
