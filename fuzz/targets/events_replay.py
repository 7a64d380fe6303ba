"""The KV-event subscriber's handling of what a publisher sends (kvstore/events/subscriber.py):
live messages (topic, seq, payload), the gaps between their sequence numbers, and the replay
socket's answers to a replay or snapshot request, as they fold into its EventView.

Input: one byte of flags (bit 0: the subscriber has a replay endpoint), then messages, each a
header byte (bit 7: an answer on the replay socket, else a live message; bits 0-2: how many
frames) and its frames, each a u16 big-endian length and that many bytes. The replay
socket's messages are queued in input order and answer the subscriber's requests as they
come (one that finds the queue empty times out at once); the live messages are handed to
the subscriber's live handler one by one. No socket carries them: the handler is called
directly, and the replay socket is an in-memory stand-in. What must hold after each live
message:

- nothing escapes the handler; a message that is not (topic, seq, payload) or does not
  decode is counted under ``decode_errors`` and changes nothing else;
- every batch applied from the live stream or a replay has a seq past the last one applied
  (a replayed one the very next), and carries the subscriber's epoch; the handler's count of
  applied batches is what the sink received;
- unfilled gaps never outnumber gaps, replay requests never outnumber gaps, and ``batches``
  counts exactly the live and replayed batches applied.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import struct
from collections import deque
from collections.abc import Callable
from typing import Any

from kvstore.events.replay_ring import snapshot_batches
from kvstore.events.subscriber import Subscriber
from kvstore.events.view import EventView
from kvstore.events.wire import (
    END_SEQ,
    SLIDING_WINDOW,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventGroup,
    WireError,
    decode_batch,
    encode_batch,
    parse_seq,
    seq_frame,
)

REPLAY, FRAMES = 0x80, 0x07
_LENGTH = struct.Struct(">H")


class _Dealer:
    """The replay socket: answers each request with the next queued messages, up to an end
    marker. Closed (after a timeout or a malformed answer), it loses the rest of the answer it
    was reading, as a new socket would never see it."""

    def __init__(self, messages: list[list[bytes]]) -> None:
        self.messages = deque(messages)
        self.requests: list[bytes] = []

    def send_multipart(self, frames: list[bytes]) -> None:
        self.requests.append(frames[-1])

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.messages)

    def recv_multipart(self) -> list[bytes]:
        return self.messages.popleft()

    def close(self) -> None:
        while self.messages and self.messages.popleft()[-2:-1] != [END_SEQ]:
            pass


class _Sink:
    """An EventView that notes, for each batch, the subscriber's last seq before it."""

    def __init__(self, sub: Subscriber) -> None:
        self.sub, self.view = sub, EventView()
        self.before: int | None = None

    def apply(self, batch: EventBatch) -> None:
        self.before = self.sub.last_seq
        self.view.apply(batch)


def _messages(data: bytes) -> tuple[list[list[bytes]], list[list[bytes]]]:
    """(live messages, replay answers) of an input, past its flags byte."""
    live: list[list[bytes]] = []
    replay: list[list[bytes]] = []
    pos = 1
    while pos < len(data):
        header = data[pos]
        pos += 1
        frames = []
        for _ in range(header & FRAMES):
            (n,) = _LENGTH.unpack_from(data[pos : pos + 2].ljust(2, b"\0"))
            frames.append(data[pos + 2 : pos + 2 + n])
            pos += 2 + n
        (replay if header & REPLAY else live).append(frames)
    return live, replay


def _decodes(frames: list[bytes]) -> bool:
    if len(frames) != 3:
        return False
    try:
        parse_seq(frames[1])
        decode_batch(frames[2])
    except WireError:
        return False
    return True


def make() -> Callable[[bytes], None]:
    logging.getLogger("kvstore.events").setLevel(logging.ERROR)  # a warning per refused message: not the finding
    # Made once and closed at once: their ZeroMQ sockets are never used (the live handler is
    # called directly, and each input's copy gets an in-memory replay socket); a subscriber
    # dropped open would hang the collector in its context's term().
    templates = {True: Subscriber("inproc://kvstore-fuzz-events", replay_endpoint="inproc://kvstore-fuzz-replay"),
                 False: Subscriber("inproc://kvstore-fuzz-events-plain")}
    for template in templates.values():
        template.close()

    def check(data: bytes) -> None:
        if not data:
            return
        live, replay = _messages(data)
        sub = copy.copy(templates[bool(data[0] & 1)])
        sub.counters, sub.media = dict(sub.counters), {}
        dealer = _Dealer(replay)
        sub._dealer = dealer  # type: ignore[assignment]
        sub._open_dealer = lambda: dealer  # type: ignore[method-assign,assignment,return-value]
        sink = sub.sink = _Sink(sub)
        applied: list[str] = []

        def on_batch(seq: int, batch: EventBatch, source: str) -> None:
            applied.append(source)
            if source == "snapshot":
                return
            assert sink.before is not None and seq > sink.before, f"{source} batch {seq} applied after {sink.before}"
            assert source == "live" or seq == sink.before + 1, f"replayed batch {seq} applied after {sink.before}"
            assert batch.epoch == sub.epoch, f"{source} batch {seq} of epoch {batch.epoch} on a view of {sub.epoch}"

        sub.on_batch = on_batch
        decode_errors = 0
        for frames in live:
            applied.clear()
            before = dict(sub.counters)
            count = sub._on_live(frames)
            assert count == len(applied), f"the handler says {count} batches applied, the sink got {len(applied)}"
            c = sub.counters
            if not _decodes(frames):
                decode_errors += 1
                assert {k: v for k, v in c.items() if k != "decode_errors"} == \
                       {k: v for k, v in before.items() if k != "decode_errors"}, "an undecodable message changed state"
                continue
            assert sub.last_seq is not None and sub._live_seq == parse_seq(frames[1])
            assert c["batches"] - before["batches"] == sum(s != "snapshot" for s in applied)
            assert c["unfilled_gaps"] <= c["gaps"] and c["replays"] <= c["gaps"], c
        assert sub.counters["decode_errors"] == decode_errors

    return check


# ----------------------------------------------------------------------------- seeds


def _frames(*frames: bytes, replay: bool = False) -> bytes:
    return bytes([(REPLAY if replay else 0) | len(frames)]) + b"".join(_LENGTH.pack(len(f)) + f for f in frames)


def _live(seq: int, batch: EventBatch) -> bytes:
    return _frames(b"kv", seq_frame(seq), encode_batch(batch))


def _answer(seq: int, batch: EventBatch, topic: bool = True) -> bytes:
    return _frames(b"", *((b"kv",) if topic else ()), seq_frame(seq), encode_batch(batch), replay=True)


END = _frames(b"", b"", END_SEQ, b"", replay=True)


def seeds() -> dict[str, bytes]:
    """Streams as kvstore's publisher and vLLM's send them: a snapshot then live batches, a
    gap replay fills, a hole it cannot (then a snapshot), a restart with a new epoch, a vLLM
    publisher (no epoch, no snapshot, replies without the topic frame), hybrid groups, and
    malformed messages."""
    ts = 1764547200.0
    k = [bytes([i]) * 32 for i in range(1, 9)]
    sliding = EventGroup(1, SLIDING_WINDOW, 512)

    def batch(epoch: int | None, *events: Any) -> EventBatch:
        return EventBatch(ts, list(events), 0, epoch)

    def stored(i: int, parent: bytes | None = None, group: EventGroup | None = None) -> BlockStored:
        event = BlockStored([k[i]], parent, [], 16, "GPU")
        return event.set_group(group) if group is not None else event

    snapshot = snapshot_batches([("GPU", 16, [(k[0], None), (k[1], k[0], sliding)]), ("CPU", 16, [(k[2], None)])],
                                7, 0, {"GPU": {"kv_cache_dtype": "int8"}})

    snapshot = [dataclasses.replace(b, ts=ts) for b in snapshot]  # (seeds are fixed bytes)

    def snap_at(seq: int) -> bytes:
        return b"".join(_answer(seq, b) for b in snapshot) + END

    snap = snap_at(3)
    on = b"\x01"
    out = {
        "snapshot-then-live": on + snap + _live(4, batch(7, stored(3, k[1]))) + _live(5, batch(7, BlockRemoved([k[0]], "GPU"))),
        "gap-filled-by-replay": on + snap + _live(4, batch(7, stored(3))) + _answer(5, batch(7, stored(4)))
        + _answer(6, batch(7, stored(5))) + _answer(7, batch(7)) + END + _live(7, batch(7)),
        "hole-then-snapshot": on + snap + _live(4, batch(7)) + _answer(6, batch(7, stored(5))) + END + snap_at(6)
        + _live(7, batch(7, stored(6))),
        "restart-new-epoch": on + snap + _live(4, batch(7)) + _live(0, batch(8, AllBlocksCleared()))
        + b"".join(_answer(1, dataclasses.replace(b, epoch=8)) for b in snapshot) + END + _live(2, batch(8, stored(7))),
        "hybrid-groups-live": on + snap + _live(4, batch(7, stored(3, None, sliding), stored(4, k[3], sliding),
                                                          BlockRemoved([k[1]], "GPU", 1))),
        "duplicate-and-late": on + snap + _live(2, batch(7)) + _live(3, batch(7)) + _live(4, batch(7)),
        "vllm-publisher": on + END + _live(0, batch(None, stored(0))) + _live(1, batch(None, stored(1, k[0])))
        + _live(3, batch(None)) + _answer(2, batch(None, stored(2)), topic=False)
        + _answer(3, batch(None), topic=False) + END + _live(0, batch(None, AllBlocksCleared())),
        "no-replay-endpoint": b"\x00" + _live(0, batch(9, stored(0))) + _live(4, batch(9, stored(1)))
        + _live(2, batch(10)),
        "malformed": on + END + _frames(b"kv", seq_frame(0)) + _frames(b"kv", b"\0\0", encode_batch(batch(1)))
        + _frames(b"kv", seq_frame(1), b"\xc1") + _live(2, batch(1)),
        "malformed-replay-answer": on + _frames(b"x", b"y", replay=True) + _live(0, batch(3))
        + _answer(0, batch(3, AllBlocksCleared())) + END,
    }
    out["snapshot-times-out"] = on + _live(4, batch(7)) + _live(5, batch(7))
    return out
