"""The daemon's resident memory through a long run of puts of random sizes and of fuzzed
frames: it must level off, not grow with the work (issue 47, docs/reliability.md).

    .venv/bin/python scripts/daemon_memory.py [--puts 1000000] [--frames 1000000]

A real ``kvstore serve`` (host tier only, ``--host-mem``, so every put past the first few
thousand evicts; no disk: a million synced writes would measure the disk, not the daemon's
memory) is driven by one client over its Unix socket: ``--puts`` puts of 1 to 16 fresh blocks
each (512-byte blocks, fresh keys: the index, the host pool and the eviction order turn over
all the time), then ``--frames`` frames of random bytes on raw connections (random lengths,
well-formed headers over garbage bodies and garbage headers, a new connection whenever the
daemon closes one). The daemon's VmRSS is sampled every ``--every`` operations. It prints the
samples, the RSS after warm-up (the first sample: pool touched, modules loaded), the largest,
the last, and exits 1 if the largest exceeds the warm-up by more than ``--bound-mib``.
"""

from __future__ import annotations

import argparse
import random
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvstore
from kvstore import KVLayout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_kill_loop import Daemon

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, block_size=4, dtype=torch.float32)  # 512 B blocks
HEADER = struct.Struct(">II")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def run_puts(daemon: Daemon, pid: int, n: int, every: int, rng: random.Random, samples: list[tuple[str, int, float]]) -> None:
    data = torch.randn((16, *LAYOUT.block_shape))
    with kvstore.connect(daemon.unix, model_id="memory", layout=LAYOUT) as client:
        key_bytes = client.hasher.key_bytes
        for i in range(1, n + 1):
            count = rng.randint(1, 16)
            keys = [rng.randbytes(key_bytes) for _ in range(count)]  # fresh keys: a put of new blocks
            client.put(keys, data[:count])
            if i % every == 0:
                samples.append(("puts", i, rss_mib(pid)))
                print(f"puts {i:>9,}: daemon RSS {samples[-1][2]:8.1f} MiB", flush=True)


def run_frames(daemon: Daemon, pid: int, n: int, every: int, rng: random.Random,
               samples: list[tuple[str, int, float]]) -> None:
    path = daemon.unix.removeprefix("unix://")
    sock: socket.socket | None = None
    for i in range(1, n + 1):
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            sock.setblocking(False)
        body = rng.randbytes(rng.randrange(0, 96))
        kind = rng.random()
        if kind < 0.7:  # a well-formed header over a garbage meta: one error frame each
            frame = HEADER.pack(len(body), 0) + body
        elif kind < 0.9:  # a header claiming data that never comes, then more garbage
            frame = HEADER.pack(len(body), rng.randrange(1, 64)) + body
        else:  # garbage from the first byte
            frame = body
        try:
            sock.sendall(frame)
            try:
                while sock.recv(1 << 16):  # drain what the daemon answered; it never blocks us
                    pass
            except BlockingIOError:
                pass
        except OSError:  # the daemon closed it (out of step, too large): a new connection
            sock.close()
            sock = None
        if sock is not None and rng.random() < 0.01:
            sock.close()
            sock = None
        if i % every == 0:
            samples.append(("frames", i, rss_mib(pid)))
            print(f"frames {i:>9,}: daemon RSS {samples[-1][2]:8.1f} MiB", flush=True)
    if sock is not None:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--puts", type=int, default=1_000_000, help="puts of 1-16 blocks (default 1,000,000)")
    parser.add_argument("--frames", type=int, default=1_000_000, help="fuzzed frames (default 1,000,000)")
    parser.add_argument("--every", type=int, default=50_000, help="operations between RSS samples (default 50,000)")
    parser.add_argument("--host-mem", default="64MiB", help="the daemon's host tier (default 64MiB)")
    parser.add_argument("--bound-mib", type=float, default=64.0,
                        help="growth over the warm-up sample that fails the run (default 64 MiB)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    samples: list[tuple[str, int, float]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvstore-memory-") as tmp:
        daemon = Daemon(Path(tmp) / "data", host_mem=args.host_mem, disk="0")
        daemon.start()
        assert daemon.proc is not None
        pid = daemon.proc.pid
        try:
            samples.append(("start", 0, rss_mib(pid)))
            run_puts(daemon, pid, args.puts, args.every, rng, samples)
            run_frames(daemon, pid, args.frames, args.every, rng, samples)
            alive = daemon.proc.poll() is None
        finally:
            daemon.stop()
    warm = next((rss for kind, _i, rss in samples if kind == "puts"), samples[0][2])
    peak = max(rss for _k, _i, rss in samples)
    print(f"daemon RSS: {samples[0][2]:.1f} MiB at start, {warm:.1f} MiB after the first {args.every:,} puts, "
          f"largest {peak:.1f} MiB, last {samples[-1][2]:.1f} MiB; {args.puts:,} puts and {args.frames:,} frames "
          f"in {time.monotonic() - started:.0f} s; the daemon {'served throughout' if alive else 'DIED'}")
    return 0 if alive and peak - warm <= args.bound_mib else 1


if __name__ == "__main__":
    sys.exit(main())
