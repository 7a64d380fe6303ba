"""``kvstore bench events``: what publishing KV events costs, against same-run baselines.

1. The engine loop: a multi-turn workload that evicts through device, host and disk, with
   ``kv_events`` on vs off (rounds interleaved, best of N): the events' overhead on the loop.
2. One producer call (``EventPublisher.stored``, one block) vs a bare ``queue.Queue.put_nowait``.
3. End to end: 20,000 stored blocks through the publisher into a Subscriber's view vs the
   same events sent one msgpack message each over raw PUB/SUB.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from kvstore.events.config import EventsConfig
from kvstore.events.publisher import EventPublisher
from kvstore.events.subscriber import Subscriber
from kvstore.services.common.argtypes import positive
from kvstore.tools.bench.harness import Row, machine, ratio_text
from kvstore.tools.bench.output import add_output_arguments, publish

TINY = dict(num_layers=2, hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=128)
NUM_E2E = 20_000


def _workload(tmp: Path, events: bool, round_no: int) -> float:
    from kvstore.engine import LLMEngine, SamplingParams

    kw: dict[str, Any] = dict(random_model=TINY, block_size=4, kv_cache_bytes=16 * 2048, host_bytes=10 * 4096,
                              disk_path=tmp / f"disk-{round_no}-{int(events)}", disk_bytes=14 * 4096,
                              fetch_policy="always", max_num_seqs=1)
    if events:
        kw["kv_events"] = "tcp://127.0.0.1:*"
    llm = LLMEngine(None, **kw)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    history = [[(7 * c + i) % 100 + 3 for i in range(9)] for c in range(3)]
    t0 = time.perf_counter()
    for t in range(6):
        outs = llm.generate(history, params)
        history = [h + o.token_ids + [(t * 5 + c) % 90 + 5] * 4 for c, (h, o) in enumerate(zip(history, outs, strict=True))]
    elapsed = time.perf_counter() - t0
    llm.close()
    return elapsed


def bench_engine(repeat: int) -> tuple[Row, float]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a loaded machine makes spinning intra-op threads the noise, not the events
    try:
        return _bench_engine(repeat)
    finally:
        torch.set_num_threads(threads)


def _bench_engine(repeat: int) -> tuple[Row, float]:
    on, off = [], []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-events-") as tmp:
        for r in range(repeat):  # interleaved: both sides see the same machine load
            off.append(_workload(Path(tmp), False, r))
            on.append(_workload(Path(tmp), True, r))
    spread = 100 * (statistics.median(on) / min(on) - 1)
    return Row("engine multi-turn workload (evicts through every tier), kv_events on", min(on), min(off),
               "the same workload, kv_events off", ">= 0.95x"), spread


def bench_producer(repeat: int) -> Row:
    n = 20_000
    keys = [i.to_bytes(4, "big") * 8 for i in range(n)]
    tokens = list(range(16))
    with EventPublisher(EventsConfig("tcp://127.0.0.1:*", replay_endpoint="", queue_size=n + 10)) as pub:
        def ours() -> None:
            for k in keys:
                pub.stored("GPU", [k], [None], 16, tokens)

        ours_s = min(_timed(ours) for _ in range(repeat)) / n
    plain: queue.Queue[Any] = queue.Queue(n + 10)

    def base() -> None:
        for k in keys:
            plain.put_nowait(("stored", "GPU", k))
        while not plain.empty():
            plain.get_nowait()

    base_s = min(_timed(base) for _ in range(repeat)) / n
    return Row("producer call: EventPublisher.stored, one block (per call)", ours_s, base_s,
               "queue.Queue.put_nowait of a tuple", ">= 0.3x")


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_end_to_end(repeat: int) -> Row:
    keys = [i.to_bytes(4, "big") * 8 for i in range(NUM_E2E)]

    def ours() -> float:
        with EventPublisher(EventsConfig("tcp://127.0.0.1:*", queue_size=NUM_E2E + 10, heartbeat_s=60)) as pub:
            sub = Subscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint or "")
            sub.poll(0.5)
            t0 = time.perf_counter()
            for k in keys:
                pub.stored("CPU", [k], [None], 16)
            while len(sub.sink) < NUM_E2E:
                sub.poll(0.05)
            elapsed = time.perf_counter() - t0
            sub.close()
        return elapsed

    def base() -> float:
        ctx = zmq.Context()
        pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)
        seen: set[bytes] = set()
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            event = {"type": "BlockStored", "block_hashes": [k], "parent_block_hash": None, "token_ids": [],
                     "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None}
            pub.send_multipart([b"", i.to_bytes(8, "big"), msgpack.packb([time.time(), [event], 0])])
        while len(seen) < NUM_E2E:
            _, _, payload = sub.recv_multipart()
            seen.update(msgpack.unpackb(payload)[1][0]["block_hashes"])
        elapsed = time.perf_counter() - t0
        pub.close(0)
        sub.close(0)
        ctx.term()
        return elapsed

    times_ours, times_base = [], []
    for _ in range(repeat):
        times_base.append(base())
        times_ours.append(ours())
    return Row(f"{NUM_E2E:,} stored blocks, producer to a Subscriber's view", min(times_ours), min(times_base),
               "raw PUB/SUB, one msgpack message per event", ">= 1.0x")


def render(rows: list[Row], spread: float) -> str:
    lines = ["## KV events (`kvstore bench events`)", "",
             f"Machine: {machine()}. Loopback TCP, publisher and subscriber in one process. Engine: the "
             "random Llama (2 layers, hidden 64), block 4, fp32, a 16-block device pool, 10 host and 14 disk "
             "slots; 6 turns of 3 interleaved conversations, one sequence at a time; one torch thread.", "",
             "| measurement | kvstore | baseline | baseline time | ratio | target | met |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        want = float(r.target.split()[1].rstrip("x"))
        unit, scale = ("us", 1e6) if r.ours_s < 1e-3 else ("ms", 1e3)
        lines.append(f"| {r.name} | {r.ours_s * scale:.2f} {unit} | {r.baseline} | {r.base_s * scale:.2f} {unit} "
                     f"| {ratio_text(r.ratio, want)}x | {r.target} | {'yes' if r.ratio >= want else 'NO'} |")
    lines += ["", f"Spread of the engine rows (median over best, kv_events on): {spread:.0f}%."]
    return "\n".join(lines)


def run_events_bench(args: argparse.Namespace) -> int:
    print("engine workload ...", flush=True)
    engine_row, spread = bench_engine(args.repeat)
    print("producer ...", flush=True)
    producer_row = bench_producer(args.repeat)
    print("end to end ...", flush=True)
    e2e_row = bench_end_to_end(max(1, args.repeat // 2))
    text = render([engine_row, producer_row, e2e_row], spread)
    publish(args, "events", text)
    return 0


def register_target(targets: argparse._SubParsersAction) -> None:
    """Add ``events`` to ``kvstore bench``'s targets."""
    p = targets.add_parser("events", help="KV events: engine overhead, producer call, end to end vs raw ZeroMQ")
    p.add_argument("--repeat", type=positive(int), default=7, help="repetitions; the best is kept (default 7)")
    add_output_arguments(p)
    p.set_defaults(func=run_events_bench)
