"""``kvstore bench daemon``: the daemon's block protocol against same-run baselines.

On loopback, 64 blocks of 192 KiB per batch: get/put over the Unix socket vs redis-server
(GET/SET of the same bytes through redis-py, pipelined, over redis's own Unix socket); get/put
over the shared-memory path vs a plain memcpy of the same bytes; the round trip of a lookup of
a 2,000-block chain. The daemon runs host-only (as redis does, in memory, no persistence).

With ``--pin`` the servers (the daemon and redis-server) get a CPU of their own and this
process (the clients and the memcpy baselines) the others: what the daemon costs where it
need not share a core with its client. Without it the kernel places every process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from kvstore.services.common.argtypes import positive
from kvstore.tools.bench.harness import (
    BENCH_LAYOUT,
    CacheFlush,
    Row,
    best_of,
    machine,
    start_service,
)
from kvstore.tools.bench.output import add_output_arguments, publish

NUM_BLOCKS = 64
RUN = 8  # shared-memory puts timed back to back


def best_pair(ours: Callable[[], object], base: Callable[[], object], repeat: int,
              after: Callable[[], object] | None = None, before: Callable[[], object] | None = None
              ) -> tuple[float, float]:
    """Best-of times of two functions run alternately, so load on a shared machine hits both;
    ``after`` runs untimed after each of ours (a put's cleanup), ``before`` untimed ahead of
    each of both."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(repeat):
        for fn, times in ((ours, a), (base, b)):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if after is not None and fn is ours:
                after()
    return min(a), min(b)


def _start_daemon(tmp: Path, host_bytes: int) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "kvstore.services.daemon", "serve", "--data-dir", str(tmp / "data"), "--disk-size", "0",
           "--host-mem", str(host_bytes), "--max-namespaces", "1", "--socket", str(tmp / "kv.sock"),
           "--listen", "", "--http", ""]
    proc, _ = start_service(cmd, "the daemon")
    return proc, f"unix://{tmp / 'kv.sock'}"


def _start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    sock = tmp / "redis.sock"
    proc = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "",
                             "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL)
    for _ in range(200):
        if sock.exists():
            return proc, str(sock)
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def split_cpus() -> tuple[set[int], set[int]]:
    """``--pin``'s CPUs: (the servers' one, the last this process may use; this process's, the
    rest). ValueError when this process may use only one."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError(f"--pin needs two CPUs or more; this process may use only CPU {cpus[0]}")
    return {cpus[-1]}, set(cpus[:-1])


def _set_affinity(cpus: set[int]) -> None:
    """Move every thread of this process (torch's workers too) onto ``cpus``; processes
    started afterwards inherit the calling thread's set."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def on_cpus(cpus: set[int] | None) -> Iterator[None]:
    """This process (every thread of it, torch's workers too, and one torch thread per CPU)
    on ``cpus`` until the block ends; processes started meanwhile inherit them. None: as is."""
    if cpus is None:
        yield
        return
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        _set_affinity(cpus)
        torch.set_num_threads(len(cpus))
        yield
    finally:
        _set_affinity(before)
        torch.set_num_threads(threads)


def run(repeat: int, pin: tuple[set[int], set[int]] | None = None) -> list[Row]:
    import redis

    from kvstore.client.client import connect

    layout, n = BENCH_LAYOUT, NUM_BLOCKS
    payload = layout.bytes_per_block
    blocks = torch.randn((n, *layout.block_shape)).to(layout.dtype)
    raw = blocks.view(torch.uint8).reshape(n, payload)
    size = f"{n} x {payload // 1024} KiB"
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-daemon-") as tmp_name, contextlib.ExitStack() as stack:
        tmp = Path(tmp_name)
        with on_cpus(pin[0] if pin else None):  # the servers run where they start
            daemon, url = _start_daemon(tmp, (RUN + 8) * n * 4096 * -(-payload // 4096))
            rserver, rsock = _start_redis(tmp)
        stack.enter_context(on_cpus(pin[1] if pin else None))
        try:
            sock_client = connect(url, layout=layout, model_id="bench", shm=False)
            shm_client = connect(url, layout=layout, model_id="bench", shm=True)
            assert shm_client.uses_shm, "the daemon did not offer shared memory"
            chains = [sock_client.block_keys(list(range(r * 10**6, r * 10**6 + n * layout.block_size)))
                      for r in range(3)]
            out = torch.empty_like(blocks)
            dst = torch.empty_like(blocks)
            dst.copy_(blocks)  # touch the pages, as the host pool's are

            r = redis.Redis(unix_socket_path=rsock)
            values = [bytes(raw[i].numpy()) for i in range(n)]  # redis-py needs bytes objects
            out_rows = out.view(torch.uint8).reshape(n, payload)

            def redis_set() -> None:
                pipe = r.pipeline(transaction=False)
                for i, v in enumerate(values):
                    pipe.set(f"blk{i}", v)
                pipe.execute()

            def redis_get() -> None:
                pipe = r.pipeline(transaction=False)
                for i in range(n):
                    pipe.get(f"blk{i}")
                for i, v in enumerate(pipe.execute()):  # into the caller's buffer, as our get does
                    out_rows[i].copy_(torch.frombuffer(bytearray(v), dtype=torch.uint8))

            def memcpy() -> None:
                dst.copy_(blocks)

            # Each put stores new blocks, and is deleted again untimed, so puts write into the
            # same host slots round after round, as redis's SETs overwrite the same keys and
            # memcpy the same buffer (an unwritten slot is colder memory than either).
            flush = CacheFlush()  # every timed call of both sides starts with cold CPU caches
            put_sock, set_s = best_pair(lambda: sock_client.put(chains[1], blocks), redis_set, repeat,
                                        after=lambda: sock_client.delete(chains[1]), before=flush)
            # Shared-memory puts return before their commit's reply, so one put alone would
            # not show what they cost: a run of RUN puts of new blocks is timed up to flush()
            # (every commit read back), against RUN copies into as many buffers. Both
            # start with the CPU caches flushed, and the run is deleted again (untimed).
            run_chains = [shm_client.block_keys(list(range((10 + r) * 10**6, (10 + r) * 10**6 + n * layout.block_size)))
                          for r in range(RUN)]
            buffers = [torch.empty_like(blocks) for _ in range(RUN)]
            for b in buffers:
                b.copy_(blocks)  # touch the pages, as the host pool's are

            def put_run() -> None:
                for keys in run_chains:
                    shm_client.put(keys, blocks)
                shm_client.flush()

            def memcpy_run() -> None:
                for b in buffers:
                    b.copy_(blocks)

            def delete_run() -> None:
                for keys in run_chains:
                    shm_client.delete(keys)

            put_run_s, copy_run_s = best_pair(put_run, memcpy_run, repeat, after=delete_run, before=flush)
            put_shm, copy_put_s = put_run_s / RUN, copy_run_s / RUN
            sock_client.put(chains[0], blocks)
            get_sock, get_s = best_pair(lambda: sock_client.get(chains[0], out=out), redis_get, repeat, before=flush)
            sock_client.get(chains[0], out=out)
            assert torch.equal(out, blocks), "socket get returned other bytes"
            get_shm, copy_get_s = best_pair(lambda: shm_client.get(chains[0], out=out), memcpy, repeat, before=flush)
            assert torch.equal(out, blocks), "shared-memory get returned other bytes"
            long_chain = sock_client.block_keys(list(range(2000 * layout.block_size)))
            sock_client.put(long_chain[:1], blocks[:1])
            lookup_s = best_of(lambda: sock_client.lookup(long_chain), max(repeat, 20))
            sock_client.close()
            shm_client.close()
        finally:
            daemon.terminate()
            rserver.terminate()
            daemon.wait(10)
            rserver.wait(10)
    rows += [
        Row(f"put over Unix socket, {size}", put_sock, set_s, "redis-server SET, redis-py pipeline", ">= 1.5x"),
        Row(f"get over Unix socket, {size}", get_sock, get_s, "redis-server GET, redis-py pipeline", ">= 1.5x"),
        Row(f"put over shared memory, {size} (a run of {RUN}, to flush())", put_shm, copy_put_s,
            f"memcpy (torch copy_) of the same bytes into {RUN} buffers in turn", ">= 0.7x"),
        Row(f"get over shared memory, {size}", get_shm, copy_get_s, "memcpy (torch copy_) of the same bytes", ">= 0.7x"),
        Row("lookup of a 2,000-block chain, round trip", lookup_s, 2e-3, "2 ms budget", "< 2 ms", "budget"),
    ]
    return rows


def render(rows: list[Row], where: str, pin: tuple[set[int], set[int]] | None = None) -> str:
    from kvstore.tools.bench.harness import render as render_rows

    text = render_rows(rows, where)
    title = "## Daemon (`kvstore bench daemon`)"
    if pin is not None:
        title = "## Daemon, servers on a CPU of their own (`kvstore bench daemon --pin`)"
        text = text.replace("Layout: 24 layers", f"The daemon and redis-server run on CPU {_cpu_list(pin[0])}, the "
                            f"clients and the memcpy baselines on CPU {_cpu_list(pin[1])} (torch with "
                            f"{len(pin[1])} thread{'s' if len(pin[1]) > 1 else ''}). Layout: 24 layers", 1)
    return text.replace("## Tiers (`kvstore bench tiers`)", title, 1).replace(
        "Layout: 24 layers", "Loopback, one process per side. Durability is equal and none on both sides: the "
        "daemon runs host-only (`--disk-size 0`: no disk tier, so no write-through fsync or LMDB commit per put; "
        "the daemon's default with a disk is write-through), redis with `--save \"\" --appendonly no` (no "
        "persistence). A socket put of blocks the store does not hold is received straight into reserved "
        "host slots, and its commit runs on the daemon's event loop; a socket get is written straight from "
        "the host slots. Each put is deleted again (untimed), so puts write the same slots round after round "
        "as SETs overwrite the same keys. Shared-memory gets copy slots named by earlier replies without a "
        "lease (checked by slot generations); shared-memory puts are pipelined (a commit's reply is read by "
        "the next request). Every timed call of both sides starts with the CPU caches flushed. Layout: 24 "
        "layers", 1)


def _cpu_list(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def run_daemon_bench(args: argparse.Namespace) -> int:
    try:
        pin = split_cpus() if args.pin else None
    except ValueError as exc:
        print(f"kvstore bench daemon: {exc}")
        return 2
    if shutil.which("redis-server") is None:
        print("kvstore bench daemon: needs redis-server (Debian package redis-server) for the baseline")
        return 2
    rows = run(args.repeat, pin)
    text = render(rows, machine(), pin)
    publish(args, "daemon-pinned" if pin else "daemon", text)
    return 0


def register_target(targets: argparse._SubParsersAction) -> None:
    """Add ``daemon`` to ``kvstore bench``'s targets."""
    p = targets.add_parser("daemon", help="daemon get/put/lookup vs redis-server and memcpy")
    p.add_argument("--repeat", type=positive(int), default=25, help="repetitions; the best is kept (default 25)")
    add_output_arguments(p)
    p.add_argument("--pin", action="store_true",
                   help="run the daemon and redis-server on the last CPU, the clients and baselines on the "
                        "others (what the daemon costs with a core of its own)")
    p.set_defaults(func=run_daemon_bench)
