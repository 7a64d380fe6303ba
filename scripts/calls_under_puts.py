"""How long a lookup, get or put waits while another process puts big batches into the same daemon.

A `kvstore serve` daemon with a disk tier; one process puts 16 blocks of 3 MiB (a vLLM save of
a 2,048-token prompt at block size 128, fp32, 24 layers) every 50 ms over shared memory, and
this process makes one call every 2 ms meanwhile: a lookup of a 16-block chain (``--op
lookup``), a get of a 2-block chain (``--op get``) or a put of one new block (``--op put``). It
prints the calls' median, p99 and maximum round trip, and how many took over 5 ms.

A put's disk work (write-through: every put; write-back: the demotions once host RAM is full)
used to run under the store's lock, and every other call of the daemon that takes the lock
waited for it. Measured on the 2-core VM, 2026-12-02, write-through:
  * lookups: p99 27 ms, max 31 ms (46 of 1,386 over 5 ms). Since a lookup reads the index
    without the lock when another thread holds it: p99 4.3-4.4 ms, max 9-11 ms (three runs),
    the same as write-back with room in host RAM (no disk write at all: p99 4.2-4.8 ms).
  * puts of one block: p99 30-31 ms, max 38-42 ms; write-back with room in host RAM (no disk
    write): p99 1.6 ms. Since a write-through put writes to disk outside the lock (it still
    returns only once its own block is on disk), and host's demotions are written once the
    lock is let go: see docs/benchmarks.md (daemon section).
  * gets (lock-free over shared memory): p99 8 ms either way.
What is left is two cores shared by the writer's copy, the daemon and this process.

    python scripts/calls_under_puts.py                       # lookups, write_through, 1 GiB of host RAM
    python scripts/calls_under_puts.py --op put              # one-block puts
    python scripts/calls_under_puts.py --write-policy write_back --host-mem 8GiB
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvstore import KVLayout
from kvstore.client.client import connect
from kvstore.services.daemon.registry import layout_to_dict

LAYOUT = KVLayout(num_layers=24, num_kv_heads=2, head_dim=64, block_size=128, dtype=torch.float32)  # 3 MiB blocks
PUT_BLOCKS, PUTS, PUT_EVERY_S, CALL_EVERY_S = 16, 40, 0.05, 0.002

WRITER = f"""
import json, sys, time, torch
from kvstore.client.client import connect
from kvstore.services.daemon.registry import layout_from_dict
layout = layout_from_dict(json.loads(sys.argv[2]))
client = connect(sys.argv[1], layout=layout, model_id="calls-under-puts")
blocks = torch.randn({PUT_BLOCKS}, *layout.block_shape)
for r in range({PUTS}):
    client.put(client.block_keys(list(range(r * 10**6, r * 10**6 + {PUT_BLOCKS} * layout.block_size))), blocks)
    time.sleep({PUT_EVERY_S})
client.flush()
client.close()
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=("lookup", "get", "put"), default="lookup",
                   help="the call timed: a lookup of 16 blocks, a get of 2, a put of 1 new block (default lookup)")
    p.add_argument("--write-policy", choices=("write_through", "write_back"), default="write_through")
    p.add_argument("--host-mem", default="1GiB", help="the daemon's host RAM (default 1GiB)")
    p.add_argument("--disk", default="4GiB", help="the daemon's disk tier (default 4GiB)")
    p.add_argument("--dir", type=Path, default=Path.cwd(), help="where the scratch data dir goes (not tmpfs)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvstore-calls-under-puts-", dir=args.dir) as tmp:
        sock = Path(tmp) / "kv.sock"
        daemon = subprocess.Popen(
            [sys.executable, "-m", "kvstore.services.daemon", "serve", "--data-dir", str(Path(tmp) / "data"),
             "--disk-size", args.disk, "--host-mem", args.host_mem, "--max-namespaces", "1", "--socket", str(sock),
             "--listen", "", "--http", "", "--write-policy", args.write_policy],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert daemon.stdout is not None
            for line in daemon.stdout:
                if "ready" in line:
                    break
            else:
                print(f"the daemon did not start (exit {daemon.wait()})")
                return 1
            url = f"unix://{sock}"
            client = connect(url, layout=LAYOUT, model_id="calls-under-puts")
            keys = client.block_keys(list(range(5 * 10**8, 5 * 10**8 + PUT_BLOCKS * LAYOUT.block_size)))
            one = torch.randn(1, *LAYOUT.block_shape)
            if args.op == "get":
                keys = keys[:2]
                client.put(keys, torch.randn(2, *LAYOUT.block_shape))
            calls = 0

            def call() -> None:
                if args.op == "lookup":
                    client.lookup(keys)
                elif args.op == "get":
                    client.get(keys)
                else:  # a new block each time
                    start = 9 * 10**8 + calls * LAYOUT.block_size
                    client.put(client.block_keys(list(range(start, start + LAYOUT.block_size))), one)

            writer = subprocess.Popen([sys.executable, "-c", WRITER, url, json.dumps(layout_to_dict(LAYOUT))])
            took: list[float] = []
            while writer.poll() is None:
                t0 = time.perf_counter()
                call()
                took.append((time.perf_counter() - t0) * 1e3)
                calls += 1
                time.sleep(CALL_EVERY_S)
            client.close()
            if writer.returncode:
                print(f"the writer failed (exit {writer.returncode})")
                return 1
        finally:
            daemon.terminate()
            daemon.wait(30)
    took.sort()
    print(f"{args.write_policy}, host {args.host_mem}: {len(took)} {args.op}s during {PUTS} puts of "
          f"{PUT_BLOCKS} x 3 MiB; median {statistics.median(took):.2f} ms, p99 {took[int(0.99 * len(took))]:.2f} ms, "
          f"max {took[-1]:.2f} ms, over 5 ms: {sum(t > 5 for t in took)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
