"""``kvstore events ENDPOINT``: print a publisher's decoded KV-event stream (a debugging aid)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvstore.errors import ConfigError
from kvstore.events.config import replay_endpoint_for
from kvstore.events.subscriber import Subscriber
from kvstore.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch, UnknownEvent


def _hash(h: bytes | int) -> str:
    return h.hex() if isinstance(h, bytes) else str(h)


def _event_dict(event: Event) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "medium": event.medium, "block_hashes": [_hash(h) for h in event.block_hashes],
                "parent_block_hash": None if event.parent_block_hash is None else _hash(event.parent_block_hash),
                "token_ids": event.token_ids, "block_size": event.block_size}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "medium": event.medium, "block_hashes": [_hash(h) for h in event.block_hashes]}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    assert isinstance(event, UnknownEvent)
    return {"type": event.tag, "unknown": True}


def _event_line(event: Event) -> str:
    if isinstance(event, BlockStored | BlockRemoved):
        first = _hash(event.block_hashes[0])[:16] if event.block_hashes else "-"
        extra = ""
        if isinstance(event, BlockStored):
            parent = "-" if event.parent_block_hash is None else _hash(event.parent_block_hash)[:16]
            extra = f" parent={parent} tokens={len(event.token_ids)}"
        return f"{type(event).__name__} {event.medium} blocks={len(event.block_hashes)} first={first}{extra}"
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared"
    return f"unknown event {event.tag!r}"


class Printer:
    """Prints batches as ``on_batch`` receives them; counts the printed ones for ``--count``.
    Snapshots (the subscriber takes one to sync, and again after a gap) only with ``snapshots``."""

    def __init__(self, as_json: bool, heartbeats: bool, snapshots: bool = True) -> None:
        self.as_json, self.heartbeats, self.snapshots, self.num_batches = as_json, heartbeats, snapshots, 0

    def __call__(self, seq: int, batch: EventBatch, source: str) -> None:
        if (batch.is_heartbeat and not self.heartbeats) or (source == "snapshot" and not self.snapshots):
            return
        self.num_batches += 1
        epoch = "-" if batch.epoch is None else f"{batch.epoch:016x}"
        if self.as_json:
            doc = {"seq": seq, "source": source, "ts": batch.ts, "epoch": batch.epoch, "snapshot": batch.snapshot,
                   "data_parallel_rank": batch.data_parallel_rank, "events": [_event_dict(e) for e in batch.events]}
            print(json.dumps(doc), flush=True)
            return
        head = f"seq={seq} epoch={epoch} {source}"
        if not batch.events:
            print(f"{head} heartbeat", flush=True)
        for event in batch.events:
            print(f"{head} {_event_line(event)}", flush=True)


def run_events(args: argparse.Namespace) -> int:
    printer = Printer(args.json, args.heartbeats, args.snapshot)
    try:
        replay = args.replay_endpoint
        if replay is None:
            replay = replay_endpoint_for(args.endpoint)
        sub = Subscriber(args.endpoint, replay_endpoint=replay if replay != "none" else "", topic=args.topic,
                         snapshot_on_start=args.snapshot, on_batch=printer)
    except ConfigError as exc:
        print(f"kvstore events: {exc}", file=sys.stderr)
        return 2
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    try:
        if args.from_seq is not None:
            for seq, batch in sub.fetch_replay(args.from_seq) or []:
                printer(seq, batch, "replay")
        while (args.count is None or printer.num_batches < args.count) and (
                deadline is None or time.monotonic() < deadline):
            sub.poll(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
    if args.stats:
        print(json.dumps(sub.stats()), file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "events", help="print a KV-event stream (engine or daemon), decoded",
        description="Subscribe to a KV-event publisher (vLLM's wire format, kvstore's or vLLM's) and print "
        "each batch, one line per event. See docs/kv-events.md.",
    )
    p.add_argument("endpoint", help="the publisher's PUB address, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--replay-endpoint", default=None,
                   help="its replay socket (default: the next port; 'none' for no replay)")
    p.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    p.add_argument("--snapshot", action="store_true", help="print a snapshot of what the publisher holds first (and the snapshots taken later "
                   "to resync after a gap replay cannot fill)")
    p.add_argument("--from-seq", type=int, default=None, help="replay buffered batches from this seq first")
    p.add_argument("--count", type=int, default=None, help="exit after this many batches")
    p.add_argument("--timeout", type=float, default=None, help="exit after this many seconds")
    p.add_argument("--heartbeats", action="store_true", help="print heartbeats (empty batches) too")
    p.add_argument("--json", action="store_true", help="one JSON object per batch (hashes as hex)")
    p.add_argument("--stats", action="store_true", help="print the subscriber's counters on exit (stderr)")
    p.set_defaults(func=run_events)
