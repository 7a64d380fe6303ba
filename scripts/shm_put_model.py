"""What a shared-memory put can reach on this machine, as a function of the daemon's CPU time.

A stand-alone model of `kvstore bench daemon`'s shared-memory put, with no kvstore code in
it: a client copies 12 MiB with torch into a shared mapping and sends a 2 KiB commit; a
server process spins for a fixed time per commit (the daemon's work, made exact) and answers
64 bytes. Eight puts make a run, timed from cold caches up to the last answer, against eight
torch copies of the same bytes into eight buffers, exactly as the real benchmark times them.

The server is woken either by the socket itself (which wakes a reader with the kernel's
"sync" hint, placing it on the writer's core) or by an eventfd (no hint: the kernel may
place it on the idle core), so the model also tells whether where the daemon runs matters,
or only how long it runs.

    python scripts/shm_put_model.py                 # work 0, 100, 150, 250 us; both wakeups
    python scripts/shm_put_model.py --work-us 120 --runs 60
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import select
import socket
import statistics
import sys
import time

import numpy as np
import torch

PUT_BYTES = 12 << 20  # 64 blocks of 192 KiB, as the benchmark puts
PUTS = 8  # a run, as the benchmark's
COMMIT, ANSWER = 2048, 64  # bytes on the wire per put
STOP = 1 << 32  # rung on the eventfd: the client is done


def serve(conn: socket.socket, doorbell: int, wake: str, work_s: float) -> None:
    """The server: for every commit, spin ``work_s`` then answer; returns when the client
    closes the socket (or, woken by the eventfd, rings ``STOP`` on it)."""
    poller = select.epoll()
    poller.register(conn.fileno() if wake == "socket" else doorbell, select.EPOLLIN)
    received = 0
    while True:
        poller.poll()
        if wake == "socket":
            chunk = conn.recv(1 << 16)
            if not chunk:
                return
            received += len(chunk)
            commits, received = divmod(received, COMMIT)
        else:
            commits = os.eventfd_read(doorbell)
            if commits >= STOP:
                return
            with contextlib.suppress(BlockingIOError):  # the commits' bytes: read them, as the daemon does
                while conn.recv(1 << 16, socket.MSG_DONTWAIT):
                    pass
        for _ in range(commits):
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < work_s:
                pass
            conn.sendall(b"a" * ANSWER)


def measure(wake: str, work_us: float, runs: int) -> tuple[float, float, float]:
    """Median put time, median copy time (seconds, per put) and their ratio."""
    shared = mmap.mmap(-1, PUTS * PUT_BYTES, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    client, server = socket.socketpair()
    doorbell = os.eventfd(0)
    pid = os.fork()
    if pid == 0:  # the server
        client.close()
        serve(server, doorbell, wake, work_us * 1e-6)
        os._exit(0)
    server.close()
    src = torch.randn(PUT_BYTES // 2).half()
    slots = [torch.frombuffer(shared, dtype=torch.float16, count=PUT_BYTES // 2, offset=i * PUT_BYTES) for i in range(PUTS)]
    buffers = [torch.empty_like(src) for _ in range(PUTS)]
    for b in buffers + slots:
        b.copy_(src)  # touch every page beforehand, on both sides
    flush_buffer = np.zeros(64 << 20, dtype=np.uint8)
    answered = 0

    def put_run() -> None:
        nonlocal answered
        for slot in slots:
            slot.copy_(src)
            client.sendall(b"c" * COMMIT)  # the same bytes travel either way; only the wakeup differs
            if wake == "eventfd":
                os.eventfd_write(doorbell, 1)
            client.setblocking(False)  # read what has been answered so far, as the client does
            with contextlib.suppress(BlockingIOError):
                answered += len(client.recv(1 << 16))
            client.setblocking(True)
        while answered < PUTS * ANSWER:
            answered += len(client.recv(1 << 16))
        answered -= PUTS * ANSWER

    def copy_run() -> None:
        for b in buffers:
            b.copy_(src)

    puts: list[float] = []
    copies: list[float] = []
    for _ in range(runs):
        for fn, times in ((put_run, puts), (copy_run, copies)):
            np.add(flush_buffer, 1, out=flush_buffer)  # cold caches, on this thread only
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) / PUTS)
    os.eventfd_write(doorbell, STOP)
    client.close()
    os.waitpid(pid, 0)
    os.close(doorbell)
    put_s, copy_s = statistics.median(puts), statistics.median(copies)
    return put_s, copy_s, copy_s / put_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-us", type=float, nargs="+", default=[0, 100, 150, 250],
                        help="the server's CPU time per commit, in microseconds (default: 0 100 150 250)")
    parser.add_argument("--wake", choices=["socket", "eventfd", "both"], default="both",
                        help="how the server is woken (default: both, in turn)")
    parser.add_argument("--runs", type=int, default=40, help="runs of eight puts per setting (default 40)")
    args = parser.parse_args(argv)
    if args.runs < 1 or any(w < 0 for w in args.work_us):
        parser.error("--runs must be positive and --work-us not negative")
    wakes = ["socket", "eventfd"] if args.wake == "both" else [args.wake]
    print(f"{'work':>8} {'wakeup':>8} {'put':>9} {'memcpy':>9} {'ratio':>6}")
    for work_us in args.work_us:
        for wake in wakes:
            put_s, copy_s, ratio = measure(wake, work_us, args.runs)
            print(f"{work_us:6.0f}us {wake:>8} {put_s * 1e3:7.3f}ms {copy_s * 1e3:7.3f}ms {ratio:6.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
