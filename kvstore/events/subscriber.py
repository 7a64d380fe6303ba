"""Subscriber: follows one publisher's KV events and keeps a sink (an EventView) exact.

It subscribes to the PUB socket and follows sequence numbers. A gap is filled by replay
from the ROUTER socket; when replay cannot fill it (older than the ring, or a hole the
publisher left for dropped events), on start, and when the boot epoch changes (a restart),
it takes a snapshot instead. ``approximate`` is True while the sink may be wrong: before the
first snapshot, after a gap nothing could fill, or while a kvstore publisher (one that sends
heartbeats) has been silent for more than ``heartbeat_timeout_s``.

A snapshot that fails (no reply in time) is tried again, backing off from 1 s to 30 s,
for as long as the sink is approximate.

It also reads plain vLLM publishers: without an epoch a restart shows as a live seq that goes
back (the live stream is in order), which clears the sink; without heartbeats it never calls
silence stale; and without snapshots it replays from seq 0 (while the publisher's ring still
holds it; otherwise the view stays approximate).

Use ``poll(timeout_s)`` from your own loop, or ``start()`` for a background thread. Socket
work happens only in the thread that polls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from kvstore.errors import ConfigError
from kvstore.events.wire import (
    END_SEQ,
    SNAPSHOT_REQUEST,
    AllBlocksCleared,
    EventBatch,
    WireError,
    decode_batch,
    parse_seq,
    seq_frame,
)

log = logging.getLogger("kvstore.events")

RETRY_MIN_S, RETRY_MAX_S = 1.0, 30.0  # the backoff of a failed snapshot's next try


class Sink(Protocol):
    def apply(self, batch: EventBatch) -> None: ...


OnBatch = Callable[[int, EventBatch, str], None]  # (seq, batch, "live" | "replay" | "snapshot")


class Subscriber:
    """Args:
        endpoint: the publisher's PUB address (``tcp://127.0.0.1:5557``).
        sink: receives every batch in sequence order (default: a new EventView, ``.sink``).
        replay_endpoint: its ROUTER address; "" for none (gaps then stay gaps).
        topic: the topic to subscribe to (prefix match, as ZeroMQ does).
        heartbeat_timeout_s: silence after which a heartbeat-sending publisher is stale.
        request_timeout_s: how long a replay or snapshot reply may pause between two messages.
        snapshot_on_start: take a snapshot before the first live batch.
        on_batch: called for each batch applied, with its seq and where it came from.
    """

    def __init__(self, endpoint: str, sink: Sink | None = None, *, replay_endpoint: str = "", topic: str = "",
                 heartbeat_timeout_s: float = 3.0, request_timeout_s: float = 2.0,
                 snapshot_on_start: bool = True, on_batch: OnBatch | None = None) -> None:
        from kvstore.events.view import EventView

        self.sink: Any = sink if sink is not None else EventView()
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.heartbeat_timeout_s, self.request_timeout_s = heartbeat_timeout_s, request_timeout_s
        self.on_batch = on_batch
        self.epoch: int | None = None
        # what each medium holds, as the publisher says on heartbeats and snapshots ({"GPU": {...}})
        self.media: dict[str, dict[str, Any]] = {}
        self.last_seq: int | None = None
        self.counters = dict.fromkeys(("batches", "gaps", "replays", "snapshots", "epochs", "decode_errors",
                                       "duplicates", "unfilled_gaps", "restarts", "errors"), 0)
        self._synced = False
        self._live_seq: int | None = None  # the last seq read from the live stream (in order)
        self._retry_s = RETRY_MIN_S  # the wait before a failed snapshot is tried again
        self._retry_at = 0.0
        self._last_heard = time.monotonic()
        self._heartbeats_seen = False
        self._can_snapshot = bool(replay_endpoint)
        self._want_snapshot = snapshot_on_start and self._can_snapshot
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._dealer: zmq.Socket | None = None
        try:  # both endpoints are checked here, not at the first replay request on the thread
            _connect(self._sub, endpoint, "event")
            if replay_endpoint:
                self._dealer = self._open_dealer()
        except ConfigError:
            self._sub.close()
            self._ctx.term()
            raise
        self._connected = True
        self._want_connected = True
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def approximate(self) -> bool:
        silent = self._heartbeats_seen and time.monotonic() - self._last_heard > self.heartbeat_timeout_s
        return not self._synced or silent

    # ----------------------------------------------------------------------------- driving

    def poll(self, timeout_s: float = 0.1) -> int:
        """Handle live messages for up to ``timeout_s`` (returns early once none is waiting
        after the first); returns how many batches were applied."""
        self._apply_connection()
        applied = 0
        if not self._synced and self._can_snapshot and self.last_seq is not None \
                and time.monotonic() >= self._retry_at:
            self._want_snapshot = True  # an earlier snapshot failed: the sink may be wrong
        if self._want_snapshot:
            self._want_snapshot = False
            applied += self._snapshot()
        deadline = time.monotonic() + timeout_s
        wait_ms = max(0, int(timeout_s * 1000))
        while self._connected and self._sub.poll(wait_ms):
            applied += self._on_live(self._sub.recv_multipart())
            wait_ms = 0 if time.monotonic() >= deadline else 1
        return applied

    def start(self) -> Subscriber:
        """Poll on a background thread until ``close()``."""
        self._thread = threading.Thread(target=self._loop, name="kvstore-events-sub", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll(0.05)
            except Exception:  # a socket error, or a sink's: the thread keeps following
                if self._stop.is_set():
                    break
                self.counters["errors"] += 1
                self._synced = False  # a batch may have been lost on the way
                log.exception("kv events subscriber: error while polling")
                time.sleep(0.1)

    def pause(self) -> None:
        """Disconnect from the live stream (events published meanwhile are missed)."""
        self._want_connected = False
        if self._thread is None:
            self._apply_connection()

    def resume(self) -> None:
        """Reconnect; the next batch reveals the gap, which replay or a snapshot fills."""
        self._want_connected = True
        if self._thread is None:
            self._apply_connection()

    def _apply_connection(self) -> None:
        if self._want_connected != self._connected:
            if self._want_connected:
                self._sub.connect(self.endpoint)
            else:
                self._sub.disconnect(self.endpoint)
            self._connected = self._want_connected

    # ----------------------------------------------------------------------------- live stream

    def _on_live(self, frames: list[bytes]) -> int:
        try:
            if len(frames) != 3:
                raise WireError(f"a message has 3 frames (topic, seq, payload), got {len(frames)}")
            seq, batch = parse_seq(frames[1]), decode_batch(frames[2])
        except WireError as exc:
            self.counters["decode_errors"] += 1
            log.warning("kv events subscriber: %s", exc)
            return 0
        self._last_heard = time.monotonic()
        self._heartbeats_seen = self._heartbeats_seen or batch.epoch is not None
        if batch.media:
            self.media = batch.media
        applied = 0
        went_back = self._live_seq is not None and seq <= self._live_seq  # a new publisher, or a new epoch
        self._live_seq = seq
        new_epoch = batch.epoch != self.epoch and self.last_seq is not None
        restarted = new_epoch or (went_back and batch.epoch is None)
        if restarted:  # the publisher restarted: nothing of the old one stands
            self.counters["restarts"] += 1
            self.counters["epochs"] += new_epoch
            self.last_seq, self._synced = None, False
        if self.last_seq is None and self._can_snapshot:
            applied += self._snapshot()
        if self.last_seq is None:
            # No snapshot: follow the stream from its first batch (seq 0), by replay where the
            # ring still has it; what cannot be filled leaves the view approximate.
            if restarted:
                self.sink.apply(EventBatch(time.time(), [AllBlocksCleared()], batch.data_parallel_rank))
            self.epoch, self.last_seq, self._synced = batch.epoch, -1, True
        if batch.epoch != self.epoch:  # the snapshot just taken is of a later boot: this batch is none of it
            return applied
        if seq <= self.last_seq:
            self.counters["duplicates"] += 1
            return applied
        if seq > self.last_seq + 1:
            self.counters["gaps"] += 1
            applied += self._fill(seq)
            if seq <= self.last_seq or batch.epoch != self.epoch:  # filled, or a snapshot of a later boot taken
                return applied
            if seq > self.last_seq + 1:
                self.counters["unfilled_gaps"] += 1
                self._synced = False
        return applied + self._apply(seq, batch, "live")

    def _apply(self, seq: int, batch: EventBatch, source: str) -> int:
        self.sink.apply(batch)
        self.last_seq = seq
        self.counters["batches"] += 1
        if self.on_batch is not None:
            self.on_batch(seq, batch, source)
        return 1

    # ----------------------------------------------------------------------------- replay

    def _fill(self, upto: int) -> int:
        """Replay ``last_seq + 1 .. upto - 1``; fall back to a snapshot when that cannot be done."""
        if not self.replay_endpoint:
            return 0
        assert self.last_seq is not None
        replies = self._request(seq_frame(self.last_seq + 1))
        self.counters["replays"] += 1
        applied = 0
        for seq, batch in replies or []:
            if batch.epoch != self.epoch or seq > self.last_seq + 1:  # restarted, or a hole
                return applied + self._snapshot()
            if seq == self.last_seq + 1:
                applied += self._apply(seq, batch, "replay")
        if replies is None or self.last_seq < upto - 1:
            applied += self._snapshot()
        return applied

    def _snapshot(self) -> int:
        """Rebuild the sink from the publisher's snapshot; 0 if it has none (a vLLM publisher)."""
        replies = self._request(SNAPSHOT_REQUEST)
        if replies is None:  # no reply in time: try again later (poll), backing off
            self._retry_at = time.monotonic() + self._retry_s
            self._retry_s = min(RETRY_MAX_S, 2 * self._retry_s)
            return 0
        if not (replies and replies[0][1].snapshot):
            self._can_snapshot = False  # a vLLM publisher: it answers only the end marker
            return 0
        self._retry_s = RETRY_MIN_S
        self.counters["snapshots"] += 1
        for seq, batch in replies:
            if batch.media:
                self.media = batch.media
            self.sink.apply(batch)
            if self.on_batch is not None:
                self.on_batch(seq, batch, "snapshot")
        self.last_seq, self.epoch = replies[0][0], replies[0][1].epoch
        self._synced = True
        return len(replies)

    def fetch_replay(self, start_seq: int) -> list[tuple[int, EventBatch]] | None:
        """The publisher's buffered batches from ``start_seq`` on, without applying them
        (None: no reply in time). For inspection; ``poll`` fills gaps by itself."""
        return self._request(seq_frame(start_seq)) if self.replay_endpoint else None

    def _open_dealer(self) -> zmq.Socket:
        """A DEALER socket connected to the replay endpoint (ConfigError when it is unusable)."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            _connect(dealer, self.replay_endpoint, "replay")
        except ConfigError:
            dealer.close()
            raise
        return dealer

    def _request(self, request: bytes) -> list[tuple[int, EventBatch]] | None:
        """Send one request on the replay socket; its replies up to the end marker, or None
        on a timeout or a malformed reply (the socket is then replaced: no stale replies)."""
        if self._dealer is None:
            self._dealer = self._open_dealer()
        dealer = self._dealer
        dealer.send_multipart([b"", request])
        out: list[tuple[int, EventBatch]] = []
        deadline = time.monotonic() + self.request_timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not dealer.poll(int(left * 1000) + 1):
                    raise TimeoutError(f"no reply from {self.replay_endpoint} in {self.request_timeout_s} s")
                frames = dealer.recv_multipart()
                # (delimiter, topic, seq, payload) from vLLM 0.32 and kvstore, (delimiter, seq,
                # payload) from vLLM before the topic frame
                if len(frames) not in (3, 4) or frames[0] != b"":
                    raise WireError(f"a replay reply is (delimiter, [topic,] seq, payload), got {len(frames)} frames")
                seq_bytes, payload = frames[-2:]
                if seq_bytes == END_SEQ:
                    return out
                out.append((parse_seq(seq_bytes), decode_batch(payload)))
                deadline = time.monotonic() + self.request_timeout_s  # a long snapshot keeps coming
        except (TimeoutError, WireError) as exc:
            log.warning("kv events subscriber: %s", exc)
            dealer.close()
            self._dealer = None
            return None

    # ----------------------------------------------------------------------------- lifecycle

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "epoch": self.epoch, "last_seq": self.last_seq, "approximate": self.approximate}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close()
        self._ctx.term()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _connect(socket: zmq.Socket, endpoint: str, what: str) -> None:
    """Connect ``socket``; ConfigError naming the endpoint when ZeroMQ cannot parse it."""
    try:
        socket.connect(endpoint)
    except zmq.ZMQError as exc:
        raise ConfigError(f"cannot connect to the {what} endpoint {endpoint!r}: {exc.strerror} (expected "
                          "tcp://HOST:PORT, ipc://PATH or inproc://NAME)") from None
