"""``kvstore bench tiers``: each tier against the plain baseline it must approach, in one run.

Every result is a ratio against a baseline measured in the same process on the same machine,
best of several repetitions (machines are shared and noisy). Results go to stdout; with
``--write PATH``, to the tiers section of PATH, and the measured read bandwidths to
bench_tiers.json beside it (``--write docs/benchmarks.md``: docs/bench_tiers.json, which
``kvstore replay`` and ``kvstore bench engine`` read).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import pickle
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import torch

from kvstore.config import StoreConfig
from kvstore.services.common.argtypes import positive
from kvstore.store import TieredStore, writes
from kvstore.store.levels import DiskLevel
from kvstore.tools.bench.harness import (
    BENCH_LAYOUT,
    CacheFlush,
    Row,
    best_of,
    dd_seconds,
    drop_page_cache,
    interleaved,
    machine,
    render,
    scratch_dir,
)
from kvstore.tools.bench.output import add_output_arguments, beside_write, publish


def bench_host(num_blocks: int, repeat: int) -> list[Row]:
    layout = BENCH_LAYOUT
    rounds = 4 * repeat  # milliseconds each: many rounds cost little and steady the floor
    store = TieredStore(StoreConfig(layout=layout, model_id="bench",
                                    host_bytes=4 * num_blocks * layout.bytes_per_block))
    blocks = torch.randn((num_blocks, *layout.block_shape)).to(layout.dtype)
    held, fresh = (store.block_keys(list(range(r * 10**6, r * 10**6 + num_blocks * layout.block_size)))
                   for r in range(2))
    store.put(held, blocks)
    out = torch.empty_like(blocks)
    dst = torch.empty_like(blocks)
    dst.copy_(blocks)  # touch the pages, as the host pool's are

    def put_new() -> None:
        store.put(fresh, blocks)  # new blocks: a put of held keys would only refresh them

    # Each round deletes the put blocks again (untimed), so every put copies into the same
    # host slots, as the baseline copies into the same buffer. Every timed call starts with
    # the CPU caches flushed (untimed), as a serving get finds them: its blocks sat in host RAM
    # while other work ran. Otherwise each side's speed would depend on what the call before
    # it left in the 32 MiB of L3, more than on what it does itself.
    flush = CacheFlush()
    put_s = get_s = copy_s = new_s = clone_s = float("inf")
    for _ in range(rounds):
        put_s = min(put_s, best_of(put_new, 1, flush))
        store.delete(fresh)
        get_s = min(get_s, best_of(lambda: store.get(held, out=out), 1, flush))
        copy_s = min(copy_s, best_of(lambda: dst.copy_(blocks), 1, flush))
        # without out=: the store allocates the result, as clone() does its copy
        new_s = min(new_s, best_of(lambda: store.get(held), 1, flush))
        clone_s = min(clone_s, best_of(blocks.clone, 1, flush))
    store.close()
    size = f"{num_blocks} x {layout.bytes_per_block // 1024} KiB"
    return [
        Row(f"host put, {size}", put_s, copy_s, "torch copy_ of the same bytes", ">= 0.8x"),
        Row(f"host get into out=, {size}", get_s, copy_s, "torch copy_ of the same bytes", ">= 0.9x"),
        Row(f"host get without out=, {size}", new_s, clone_s, "torch clone() of the same bytes", ">= 0.8x"),
    ]


GET_BLOCKS, PUT_BLOCKS = 64, 256  # the get beside puts: a load's prefix, and a saver's batches


def bench_get_beside_puts(seconds: float) -> list[Row]:
    """The p99 of a host get of 64 blocks while another thread puts 256-block batches (48 MiB,
    each deleted again), against the same with every put copying under the store lock, as
    puts did before ``writes.UNLOCKED_COPY_BYTES``: how long a load waits behind a save (the
    vLLM connector's saver thread, the engine's demoter). Both sides alternate in rounds."""
    layout = BENCH_LAYOUT
    store = TieredStore(StoreConfig(layout=layout, model_id="bench",
                                    host_bytes=(GET_BLOCKS + PUT_BLOCKS + 16) * layout.bytes_per_block))
    held = store.block_keys(list(range(GET_BLOCKS * layout.block_size)))
    store.put(held, torch.randn((GET_BLOCKS, *layout.block_shape)).to(layout.dtype))
    batch = torch.randn((PUT_BLOCKS, *layout.block_shape)).to(layout.dtype)
    chains = [store.block_keys(list(range(r * 10**5, r * 10**5 + PUT_BLOCKS * layout.block_size)))
              for r in range(1, 9)]
    out = torch.empty((GET_BLOCKS, *layout.block_shape), dtype=layout.dtype)
    unlocked = writes.UNLOCKED_COPY_BYTES

    def gets_beside_puts(duration: float) -> list[float]:
        stop = threading.Event()

        def putter() -> None:
            for keys in itertools.cycle(chains):
                if stop.is_set():
                    return
                store.put(keys, batch)
                store.delete(keys)

        thread = threading.Thread(target=putter, name="bench-putter")
        thread.start()
        times: list[float] = []
        try:
            time.sleep(0.05)  # the putter is under way
            end = time.monotonic() + duration
            while time.monotonic() < end:
                t0 = time.perf_counter()
                store.get(held, out=out)
                times.append(time.perf_counter() - t0)
                time.sleep(0.002)  # a load every few ms, not a spin on the lock
        finally:
            stop.set()
            thread.join()
        return times

    ours: list[float] = []
    locked: list[float] = []
    rounds = 4
    try:
        for _ in range(rounds):
            writes.UNLOCKED_COPY_BYTES = unlocked
            ours += gets_beside_puts(seconds / rounds / 2)
            writes.UNLOCKED_COPY_BYTES = 1 << 62  # every put copies under the store lock
            locked += gets_beside_puts(seconds / rounds / 2)
    finally:
        writes.UNLOCKED_COPY_BYTES = unlocked
        store.close()
    return [Row(f"host get of {GET_BLOCKS} x {layout.bytes_per_block // 1024} KiB beside a thread putting "
                f"{PUT_BLOCKS}-block batches, p99 ({len(ours)} gets)", float(np.percentile(ours, 99)),
                float(np.percentile(locked, 99)),
                "same, every put copying under the store lock", ">= 2x", ratio_kind="lower")]


CEILING_GBPS = 4.0  # what a read from a tmpfs slab must reach on two cores (the store's own ceiling)


DISK_SIZES = (40, 256, 1024)  # the size sweep's prefixes: 8, 50 and 201 MB of 192 KiB blocks
SMALL_READ_TARGET = 0.6  # a short read's share of dd's rate (its fixed costs weigh more)


def bench_disk(num_blocks: int, repeat: int, workdir: Path, medium: str = "disk",
               ceiling_gbps: float | None = None, promotion: str = "never",
               host_blocks: int | None = None, write_row: bool = True) -> tuple[list[Row], str]:
    """A cold read (a reopened store, the slab's pages dropped) and a write-through put of
    ``num_blocks`` against dd on the same medium: ``dd iflag=direct`` with 4 MiB requests
    reads the very extents that hold the blocks (the medium's own rate). With
    ``ceiling_gbps``, only the read, as a rate against that one (dd's named beside it). The
    read promotes as ``promotion`` says, into a host tier of ``host_blocks`` (default: twice
    the read); without ``write_row`` only the read's row comes back."""
    layout = BENCH_LAYOUT
    payload = layout.bytes_per_block
    disk_dir = workdir / "disk"
    cfg = StoreConfig(layout=layout, model_id="bench", host_bytes=(host_blocks or 2 * num_blocks) * payload,
                      disk_path=disk_dir, disk_bytes=(repeat + 2) * num_blocks * payload,
                      write_policy="write_through", promotion=promotion)
    store = TieredStore(cfg)
    blocks = torch.randn((num_blocks, *layout.block_shape)).to(layout.dtype)
    chains = [store.block_keys(list(range(r * 10**6, r * 10**6 + num_blocks * layout.block_size))) for r in range(repeat + 1)]
    it = iter(chains)
    # write-through: put returns after the payloads are written, synced and cataloged
    write_s = best_of(lambda: store.put(next(it), blocks), repeat)
    disk_level = store.level("disk")
    direct = "O_DIRECT" if isinstance(disk_level, DiskLevel) and disk_level.tier.direct_io else "buffered+fadvise"
    # dd reads the very extents that hold each chain (unwritten extents would read as free zeros)
    extents = []
    for keys in chains[:repeat]:
        slots = sorted(int(store.view.block_info(k)["slots"]["disk"]) for k in keys)  # type: ignore[index]
        extents.append((slots[0], slots[-1] - slots[0] + 1))
    store.close()
    slabs = sorted(p for p in disk_dir.rglob("*") if p.is_file() and p.stat().st_size >= num_blocks * payload)
    slab = max(slabs, key=lambda p: p.stat().st_size)
    out = torch.empty_like(blocks)

    def ours(r: int) -> float:
        reopened = TieredStore(cfg)  # a fresh store: nothing of the slab is in host RAM
        drop_page_cache(slab)
        t0 = time.perf_counter()
        reopened.get(chains[r], out=out)
        elapsed = time.perf_counter() - t0
        reopened.close()
        assert torch.equal(out, blocks), "disk tier returned other bytes"
        return elapsed

    def dd(r: int) -> float:
        first, count = extents[r]
        flags = "direct,skip_bytes,count_bytes" if direct == "O_DIRECT" else "skip_bytes,count_bytes"
        return dd_seconds([f"if={slab}", "of=/dev/null", "bs=4M", f"skip={first * cfg.slot_bytes}",
                           f"count={count * cfg.slot_bytes}", f"iflag={flags}"])

    # Interleaved, each repetition on its own chain, taking turns at going first: a virtual
    # disk's host-side cache warmed by one reader must not favour only the other.
    reads, dd_reads = [], []
    for r in range(repeat):
        if r % 2:
            dd_reads.append(dd(r))
            reads.append(ours(r))
        else:
            reads.append(ours(r))
            dd_reads.append(dd(r))
    read_s, dd_read = min(reads), min(dd_reads)
    size = f"{num_blocks} x {payload // 1024} KiB"
    dd_name = "dd iflag=direct bs=4M" if direct == "O_DIRECT" else "dd bs=4M"
    nbytes = num_blocks * payload
    promoted = "" if promotion == "never" else f", promotion={promotion!r} into a {host_blocks or 2 * num_blocks}-block host tier"
    read_name = f"{medium} cold read ({direct}), {size}{promoted}: {nbytes / read_s / 1e9:.2f} GB/s"
    if ceiling_gbps is not None:
        budget_s = nbytes / ceiling_gbps / 1e9
        return [Row(f"{read_name} ({dd_name}: {nbytes / dd_read / 1e9:.2f} GB/s)", read_s, budget_s,
                    f"{ceiling_gbps:g} GB/s", f"< {budget_s * 1e3:.1f} ms", ratio_kind="budget")], direct
    read_row = Row(read_name, read_s, dd_read, dd_name, f">= {SMALL_READ_TARGET if nbytes < 16 << 20 else 0.8}x")
    if not write_row:
        return [read_row], direct
    target = workdir / "dd-write"
    dd_write = min(dd_seconds(["if=/dev/zero", f"of={target}", f"bs={payload}", f"count={num_blocks}",
                                "oflag=direct", "conv=fdatasync"]) for _ in range(repeat))
    return [
        read_row,
        Row(f"{medium} write + sync + catalog, {size}", write_s, dd_write, "dd oflag=direct conv=fdatasync", ">= 0.7x"),
    ], direct


def bench_disk_sweep(repeat: int, workdir: Path) -> list[Row]:
    """The cold read at each of ``DISK_SIZES`` without promotion, and with the default one
    (``promotion="get"``) into a host tier of 4 blocks (smaller than the read: it promotes
    what fits and reads the rest into the caller's memory) and into one that holds it all."""
    rows: list[Row] = []
    for num_blocks in DISK_SIZES:
        for promotion, host_blocks in (("never", None), ("get", 4), ("get", 2 * num_blocks)):
            with scratch_dir(str(workdir), f"disk-{num_blocks}-{promotion}") as where:
                rows += bench_disk(num_blocks, repeat, where, promotion=promotion, host_blocks=host_blocks,
                                   write_row=False)[0]
    return rows


def vllm_style_keys(tokens: list[int], block_size: int) -> list[bytes]:
    """vLLM's recipe, reimplemented for comparison: SHA-256 of pickle((parent, tokens, extras))."""
    parent, keys = b"\x00" * 32, []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        data = pickle.dumps((parent, tuple(tokens[i : i + block_size]), None), protocol=pickle.HIGHEST_PROTOCOL)
        parent = hashlib.sha256(data).digest()
        keys.append(parent)
    return keys


def bench_keys(num_tokens: int, repeat: int) -> list[Row]:
    store = TieredStore(StoreConfig(layout=BENCH_LAYOUT, model_id="bench", host_bytes=1 << 22))
    tokens = np.random.default_rng(0).integers(0, 128_000, num_tokens).tolist()
    ours, base = interleaved([lambda: store.block_keys(tokens, tenant="acme"),
                              lambda: vllm_style_keys(tokens, BENCH_LAYOUT.block_size)], 6 * repeat)
    keys = store.block_keys(tokens)[:1000]
    store.put(keys[:1], torch.zeros((1, *BENCH_LAYOUT.block_shape), dtype=BENCH_LAYOUT.dtype))
    lookup = best_of(lambda: store.lookup(keys), repeat)
    store.close()
    return [
        Row(f"key hashing, {num_tokens // 1024}k-token prompt (SHA-256)", ours, base,
            "vLLM recipe: SHA-256(pickle(parent, tokens, extras))", ">= 2x", "speedup"),
        Row("lookup of a 1,000-block chain", lookup, 1e-3, "1 ms budget", "< 1 ms", "budget"),
    ]


def run_tiers(args: argparse.Namespace) -> int:
    if shutil.which("dd") is None:
        print("kvstore bench tiers: needs dd (coreutils) for the disk baselines")
        return 2
    rows: list[Row] = []
    with scratch_dir(args.dir, "tiers") as tmp:
        print("host tier ...", flush=True)
        rows += bench_host(args.host_blocks, args.repeat)
        print("host get beside puts ...", flush=True)
        beside = bench_get_beside_puts(args.beside_seconds)
        print("disk tier ...", flush=True)
        disk_rows, _mode = bench_disk(args.disk_blocks, args.repeat, tmp)
        rows += disk_rows
        shm = Path("/dev/shm")
        if shm.is_dir() and os.access(shm, os.W_OK):
            print("disk tier on tmpfs (the store's own ceiling) ...", flush=True)
            with scratch_dir(str(shm), "tiers") as ram:
                tmpfs_rows, _mode = bench_disk(args.disk_blocks, args.repeat, ram, "tmpfs slab", CEILING_GBPS)
            rows += tmpfs_rows
        if not args.no_disk_sweep:
            print(f"disk cold reads of {', '.join(map(str, DISK_SIZES))} blocks, promoting and not ...", flush=True)
            rows += bench_disk_sweep(args.repeat, tmp)
        print("keys ...", flush=True)
        rows += bench_keys(32 * 1024, args.repeat)
    rows += beside
    text = render(rows, machine())
    publish(args, "tiers", text)
    bandwidths = beside_write(args, "bench_tiers.json")
    if bandwidths is not None:
        host_get, disk_read = rows[1], rows[3]
        gbps = {
            "host_read_gbps": args.host_blocks * BENCH_LAYOUT.bytes_per_block / host_get.ours_s / 1e9,
            "disk_read_gbps": args.disk_blocks * BENCH_LAYOUT.bytes_per_block / disk_read.ours_s / 1e9,
            "machine": machine(),
        }
        bandwidths.write_text(json.dumps(gbps, indent=2) + "\n")
        print(f"wrote {bandwidths}")
    return 0


def register_target(targets: argparse._SubParsersAction) -> None:
    tiers = targets.add_parser("tiers", help="host/disk tier throughput, key hashing, a get beside puts vs baselines")
    tiers.add_argument("--host-blocks", type=positive(int), default=128, help="blocks per host get/put (default 128)")
    tiers.add_argument("--disk-blocks", type=positive(int), default=256, help="blocks per disk read/write (default 256)")
    tiers.add_argument("--repeat", type=positive(int), default=5, help="repetitions; the best is kept (default 5)")
    tiers.add_argument("--no-disk-sweep", action="store_true",
                       help="skip the disk cold reads of 8, 50 and 201 MB with and without promotion (a minute or so)")
    tiers.add_argument("--beside-seconds", type=positive(float), default=8.0,
                       help="seconds of gets beside a putting thread, both sides together (default 8)")
    tiers.add_argument("--dir", help="where to create the scratch disk tier (default: current directory; "
                       "must not be tmpfs for O_DIRECT)")
    add_output_arguments(tiers, beside="bench_tiers.json")
    tiers.set_defaults(func=run_tiers)
