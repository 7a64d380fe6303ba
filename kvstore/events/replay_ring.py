"""The replay socket's side of a publisher: the ring of recent batches and the requests.

vLLM's framing (0.32): a client (REQ, or DEALER sending an empty delimiter first) sends one
frame, the start sequence number as u64 big-endian; the ROUTER answers with one message
``(topic, seq, payload)`` per buffered batch whose seq is >= start, then
``(b"", END_SEQ, b"")``. (vLLM before the topic frame sent ``(seq, payload)``; the
Subscriber reads both.)

kvstore's extension: the request frame ``SNAPSHOT_REQUEST`` (16 bytes, so a vLLM publisher
reads it as an out-of-range seq and answers only the end marker) is answered with the
publisher's whole state as of seq N: messages ``(topic, N, batch)`` whose batches carry
``snapshot: true``, the first holding ``AllBlocksCleared``, the rest ``BlockStored`` runs
(each of one KV group, its fields as the live events carry them), then the end marker. A
consumer applies them, then every live batch after N.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import zmq

from kvstore.events.wire import (
    END_SEQ,
    FULL_GROUP,
    SNAPSHOT_REQUEST,
    AllBlocksCleared,
    BlockHash,
    BlockStored,
    Event,
    EventBatch,
    EventGroup,
    encode_batch,
    seq_frame,
)

log = logging.getLogger("kvstore.events")
SNAPSHOT_CHUNK = 1024  # block hashes per snapshot batch
# What a snapshot source returns per medium: (medium, block_size, blocks), each block (key, parent)
# (a layout without groups: FULL_GROUP) or (key, parent, group) (None: its group is not known).
HeldBlock = tuple[bytes, bytes | None] | tuple[bytes, bytes | None, EventGroup | None]
Held = tuple[str, int, Sequence[HeldBlock]]


class ReplayRing:
    """The last ``capacity`` published batches, at most ``max_bytes`` of payload, oldest first
    (used by the publisher thread only)."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self._ring: deque[tuple[int, bytes]] = deque()
        self.capacity, self.max_bytes = capacity, max_bytes
        self.num_bytes = 0

    def append(self, seq: int, payload: bytes) -> None:
        self._ring.append((seq, payload))
        self.num_bytes += len(payload)
        while len(self._ring) > self.capacity or (self.num_bytes > self.max_bytes and len(self._ring) > 1):
            self.num_bytes -= len(self._ring.popleft()[1])

    def since(self, start: int) -> list[tuple[int, bytes]]:
        return [(s, p) for s, p in self._ring if s >= start]

    def __len__(self) -> int:
        return len(self._ring)


def snapshot_batches(held: Iterable[Held], epoch: int, rank: int,
                     media: dict[str, dict[str, Any]] | None = None) -> list[EventBatch]:
    """The snapshot reply's batches: AllBlocksCleared (with the media's metadata), then each
    medium's blocks as chain runs (a run continues while a block's parent is the block before
    it and its group is the run's), at most SNAPSHOT_CHUNK hashes a batch."""
    ts = time.time()
    out = [EventBatch(ts, [AllBlocksCleared()], rank, epoch, snapshot=True, media=media or None)]
    events: list[Event] = []
    size = 0

    def add(event: BlockStored) -> None:
        nonlocal events, size
        if events and size + len(event.block_hashes) > SNAPSHOT_CHUNK:
            out.append(EventBatch(ts, events, rank, epoch, snapshot=True))
            events, size = [], 0
        events.append(event)
        size += len(event.block_hashes)

    for medium, block_size, blocks in held:
        run: list[BlockHash] = []
        parent: BlockHash | None = None
        group: EventGroup | None = FULL_GROUP
        for block in blocks:
            key, key_parent = block[0], block[1]
            key_group = block[2] if len(block) > 2 else FULL_GROUP
            if run and key_parent == run[-1] and key_group == group and len(run) < SNAPSHOT_CHUNK:
                run.append(key)
                continue
            if run:
                add(BlockStored(run, parent, [], block_size, medium).set_group(group))
            run, parent, group = [key], key_parent, key_group
        if run:
            add(BlockStored(run, parent, [], block_size, medium).set_group(group))
    if events:
        out.append(EventBatch(ts, events, rank, epoch, snapshot=True))
    return out


def serve_request(sock: zmq.Socket, ring: ReplayRing, last_seq: int,
                  snapshot: Callable[[], list[EventBatch]], topic: bytes = b"") -> str:
    """Answer one waiting request on the ROUTER ``sock``; returns its kind
    ("replay", "snapshot" or "invalid")."""
    frames = sock.recv_multipart()
    if len(frames) == 3 and frames[1] == b"":
        envelope, request = frames[:2], frames[2]
    elif len(frames) == 2:
        envelope, request = frames[:1], frames[1]
    else:
        log.warning("kv events: ignoring a replay request of %d frames", len(frames))
        return "invalid"
    kind = "invalid"
    replies: list[tuple[bytes, bytes]] = []
    if request == SNAPSHOT_REQUEST:
        kind = "snapshot"
        n = seq_frame(max(last_seq, 0))
        try:
            replies = [(n, encode_batch(b)) for b in snapshot()]
        except Exception:  # a source failed (a store closing, say): no reply, the client asks again
            log.exception("kv events: a snapshot source failed; the snapshot request is not answered")
            return "snapshot_error"
    elif len(request) == 8:
        kind = "replay"
        replies = [(seq_frame(s), p) for s, p in ring.since(int.from_bytes(request, "big"))]
    try:
        for seq, payload in replies:
            sock.send_multipart([*envelope, topic, seq, payload], flags=zmq.NOBLOCK)
        sock.send_multipart([*envelope, b"", END_SEQ, b""], flags=zmq.NOBLOCK)
    except zmq.ZMQError as exc:  # full (Again) or gone (EHOSTUNREACH, ROUTER_MANDATORY): the
        # reply stops before its end marker, so the client times out and asks again
        log.warning("kv events: a replay reply was cut short: %s", exc.strerror)
    return kind
