"""EventPublisher: what the tiers hold, as a stream of KV-event batches on ZeroMQ.

Producers (the engine loop, the store under its lock) call ``stored``/``removed``/``cleared``:
each appends one item to a bounded deque (no lock, no wake-up) and returns at once; a full
queue drops the item and counts it. One publisher thread owns both sockets: every
``POLL_S`` it takes what is queued and packs it into batches of at most ``max_batch_events``
items, sent back to back (consecutive chain runs of one medium and KV group merge into one
``BlockStored``; blocks of several groups make one event per group), gives each the next seq,
sends it on the PUB socket, keeps it in the replay ring, answers replay and snapshot requests
between batches, and sends a heartbeat (an empty batch) after ``heartbeat_s`` of silence.

Every batch carries the boot epoch (a random u64 chosen at start) in kvstore's extension
element. A dropped item leaves a hole in the sequence numbers: consumers see a gap that no
replay can fill and take a snapshot, which is read from the sources (the tiers' own state),
not from the stream, so they converge again.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvstore.errors import ConfigError
from kvstore.events.config import EventsConfig
from kvstore.events.replay_ring import Held, ReplayRing, serve_request, snapshot_batches
from kvstore.events.wire import (
    FULL_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    EventGroup,
    encode_batch,
    seq_frame,
)

log = logging.getLogger("kvstore.events")
# How often the thread looks for queued items and replay requests. Producers never wake it:
# waking a thread per event costs the engine loop more than the event (GIL hand-offs).
POLL_S = 0.005
Source = Callable[[], list[Held]]
# queue items: ("stored", medium, keys, parents, block_size, tokens, groups) | ("removed", medium, keys,
# groups) | ("cleared",); groups: one EventGroup (or None) for every key, or a list of one per key
_Item = tuple[Any, ...]
Groups = EventGroup | None | list[EventGroup | None]


class EventPublisher:
    """Publishes KV events for one engine or daemon. Thread-safe producers; one thread.

    Args:
        config: sockets, topic, buffer sizes, heartbeat.

    Raises:
        ConfigError: an endpoint cannot be bound (in use, bad address).
    """

    def __init__(self, config: EventsConfig) -> None:
        self.config = config
        self.epoch = secrets.randbits(64)
        self._queue: deque[_Item] = deque()
        self._sources: list[Source] = []
        self._sources_lock = threading.Lock()
        self._ring = ReplayRing(config.buffer_batches, config.buffer_bytes)
        self.topic = config.topic
        self._topic = config.topic.encode()
        self._seq = 0  # the next batch's sequence number
        self._num_dropped = 0
        self._holes = 0  # drops already turned into a skipped seq
        self._media: dict[str, dict[str, Any]] = {}  # set_media: replaced whole, never changed in place
        self._drop_lock = threading.Lock()
        self.counters = dict.fromkeys(("batches", "events", "heartbeats", "replays", "snapshots",
                                       "snapshot_errors", "invalid_requests", "dropped_events", "send_errors"), 0)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 500)
        self._router: zmq.Socket | None = None
        try:
            self._pub.bind(config.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if config.replay_endpoint:
                self._router = self._ctx.socket(zmq.ROUTER)
                # room for a whole replay, or a snapshot of ~100M blocks, queued at once
                self._router.setsockopt(zmq.SNDHWM, max(config.buffer_batches + 64, 100_000))
                self._router.setsockopt(zmq.LINGER, 0)
                # a reply that cannot be queued whole fails (and is never ended by the end
                # marker) instead of losing messages in its middle unseen
                self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._router.bind(config.replay_endpoint)
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(f"cannot bind KV events on {config.endpoint} / {config.replay_endpoint}: "
                              f"{exc}") from None
        self._stop = threading.Event()
        self._final_clear = False
        self._last_send = 0.0
        self._send([AllBlocksCleared()])  # seq 0: whatever an earlier process announced is gone
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------- producers

    def stored(self, medium: str, keys: Sequence[bytes], parents: Sequence[bytes | None], block_size: int,
               token_ids: Sequence[int] | None = None, *, group: EventGroup | None = FULL_GROUP,
               groups: Sequence[EventGroup | None] | None = None) -> bool:
        """``medium`` now holds ``keys`` (``parents[i]`` is key i's parent). Never blocks; False
        when the queue was full and the event was dropped.

        Args:
            token_ids: the blocks' tokens, concatenated in ``keys`` order, or None where the
                tier does not know them.
            group: the KV group of every key (kvstore/events/groups.py ``event_groups``): its
                index, kind and window go on the wire. The default is a layout without groups
                (group 0, full attention); None: not known (no group fields).
            groups: instead, the group of each key. A call of several groups is published as
                one event per group (and chain run).
        """
        return self._put(("stored", medium, list(keys), list(parents), block_size,
                          None if token_ids is None else list(token_ids), _groups(group, groups, keys)))

    def removed(self, medium: str, keys: Sequence[bytes], *, group: EventGroup | None = FULL_GROUP,
                groups: Sequence[EventGroup | None] | None = None) -> bool:
        """The last copy of each of ``keys`` left ``medium``; ``group``/``groups`` as for
        ``stored`` (only the index goes on the wire). Never blocks (False: dropped)."""
        return self._put(("removed", medium, list(keys), _groups(group, groups, keys)))

    def cleared(self) -> bool:
        """The publisher holds nothing any more, on any medium."""
        return self._put(("cleared",))

    def _put(self, item: _Item) -> bool:
        # len + append is not one atomic step: with several producer threads the bound can be
        # passed by at most one item per thread, which is fine for a memory bound.
        if self._stop.is_set():
            return False
        if len(self._queue) >= self.config.queue_size:
            with self._drop_lock:
                self._num_dropped += 1
            return False
        self._queue.append(item)
        return True

    def add_source(self, source: Source) -> None:
        """Register a snapshot source: a callable returning ``[(medium, block_size, [(key,
        parent)])]``, the blocks a tier holds now (``(key, parent, group)`` where a block's KV
        group is not ``FULL_GROUP``; kvstore/events/replay_ring.py). Called on the publisher
        thread; it must be safe to call from another thread."""
        with self._sources_lock:
            self._sources.append(source)

    def remove_source(self, source: Source) -> None:
        with self._sources_lock:
            self._sources.remove(source)

    # ----------------------------------------------------------------------------- thread

    def _run(self) -> None:
        try:
            while not self._stop.wait(POLL_S):
                self._step()
            self._drain()
            if self._final_clear:
                self._send([AllBlocksCleared()])
        except Exception:  # pragma: no cover - a bug here must not take the engine down
            log.exception("kv events: the publisher thread failed")
        finally:
            self._close_sockets()

    def _step(self) -> None:
        """Send what is queued now, in batches of at most ``max_batch_events`` items back to
        back (a burst is not paced at one batch a tick), answering requests between them."""
        queued = self._queue
        backlog = len(queued)  # items queued later wait for the next tick: a steady stream cannot hold the thread
        self._serve_requests()
        if not backlog:
            if time.monotonic() - self._last_send >= self.config.heartbeat_s:
                self._send([], media=True)
                self.counters["heartbeats"] += 1
            return
        while backlog > 0:
            take = min(backlog, self.config.max_batch_events)
            items = [queued.popleft() for _ in range(take)]  # only this thread takes items
            backlog -= take
            self._send(_pack(items))
            if backlog:
                self._serve_requests()

    def _drain(self) -> None:
        while self._queue:
            self._step()

    def _serve_requests(self) -> None:
        router = self._router
        while router is not None and router.poll(0):
            kind = serve_request(router, self._ring, self._seq - 1, self._snapshot, self._topic)
            key = {"replay": "replays", "snapshot": "snapshots", "snapshot_error": "snapshot_errors"}.get(
                kind, "invalid_requests")
            self.counters[key] += 1

    def _snapshot(self) -> list[EventBatch]:
        with self._sources_lock:
            sources = list(self._sources)
        held: list[Held] = []
        for source in sources:
            held += source()
        return snapshot_batches(held, self.epoch, self.config.data_parallel_rank, dict(self._media))

    def _send(self, events: list[Event], media: bool = False) -> None:
        with self._drop_lock:
            dropped = self._num_dropped
        if dropped != self._holes:  # items were lost: leave a hole so consumers resync
            self.counters["dropped_events"] = dropped
            self._holes = dropped
            self._seq += 1
        seq = self._seq
        self._seq += 1
        payload = encode_batch(EventBatch(time.time(), events, self.config.data_parallel_rank, self.epoch,
                                          media=dict(self._media) if media and self._media else None))
        try:
            self._pub.send_multipart([self._topic, seq_frame(seq), payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counters["send_errors"] += 1
        self._ring.append(seq, payload)
        self._last_send = time.monotonic()
        self.counters["batches"] += 1
        self.counters["events"] += len(events)

    # ----------------------------------------------------------------------------- lifecycle

    def set_media(self, medium: str, info: dict[str, Any]) -> None:
        """What ``medium`` holds (e.g. ``{"kv_cache_dtype": "int8"}``): sent on heartbeats and
        snapshots, and in ``info()`` (values: str, int, float)."""
        self._media = {**self._media, medium: dict(info)}  # a new dict: the thread reads it unlocked

    def info(self) -> dict[str, Any]:
        """Where consumers connect: ``endpoint``, ``replay_endpoint`` (bound addresses), ``topic``,
        ``epoch``, and ``media`` (``set_media``)."""
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "topic": self.config.topic, "epoch": self.epoch, "media": dict(self._media)}

    def stats(self) -> dict[str, int]:
        """Counters: batches, events, heartbeats, replays, snapshots, invalid_requests,
        dropped_events (a full queue), send_errors; plus queued, seq and epoch."""
        with self._drop_lock:
            dropped = self._num_dropped
        return {**self.counters, "dropped_events": dropped, "queued": len(self._queue),
                "seq": self._seq - 1, "epoch": self.epoch}

    def close(self, clear: bool = True) -> None:
        """Publish what is queued (and, with ``clear``, a final AllBlocksCleared), then close
        the sockets. Idempotent."""
        if self._stop.is_set():
            return
        self._final_clear = clear
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None and not sock.closed:
                sock.close()
        self._ctx.term()

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _groups(group: EventGroup | None, groups: Sequence[EventGroup | None] | None,
            keys: Sequence[bytes]) -> Groups:
    if groups is None:
        return group
    if len(groups) != len(keys):
        raise ValueError(f"{len(groups)} groups for {len(keys)} keys")
    first = groups[0] if groups else group
    return first if all(g == first for g in groups) else list(groups)


def _by_group(groups: Groups, num_keys: int) -> list[tuple[EventGroup | None, list[int]]]:
    """The positions of each group's keys, groups in order of first appearance."""
    if not isinstance(groups, list):
        return [(groups, list(range(num_keys)))]
    positions: dict[EventGroup | None, list[int]] = {}
    for i, g in enumerate(groups):
        positions.setdefault(g, []).append(i)
    return list(positions.items())


def _open_event(events: list[Event], kind: type[BlockStored] | type[BlockRemoved], medium: str,
                group_idx: int | None) -> BlockStored | BlockRemoved | None:
    """The event a new run of (``kind``, ``medium``, group) may extend: the latest one of that
    kind and medium, if only events of that kind and medium for other groups follow it (events
    of other groups touch other keys, so extending an earlier one reorders nothing that matters).
    With one group this is the last event or none: a layout without groups packs as before."""
    for event in reversed(events):
        if not isinstance(event, kind) or event.medium != medium:
            return None
        if event.group_idx == group_idx:
            return event
    return None


def _pack(items: list[_Item]) -> list[Event]:
    """Queued items -> events: each stored item is split by KV group and cut into chain runs,
    and a run that continues an open BlockStored (same medium, group and block size, tokens
    known for both or neither) extends it; removals of one medium and group merge alike."""
    events: list[Event] = []
    for item in items:
        kind = item[0]
        if kind == "stored":
            _, medium, keys, parents, block_size, tokens, groups = item
            for group, positions in _by_group(groups, len(keys)):
                idx = None if group is None else group.idx
                last = _open_event(events, BlockStored, medium, idx)
                for i in positions:
                    key = keys[i]
                    span = tokens[i * block_size : (i + 1) * block_size] if tokens is not None else None
                    if (isinstance(last, BlockStored) and last.block_size == block_size
                            and last.group == group and last.block_hashes[-1] == parents[i]
                            and (span is None) == (not last.token_ids)):
                        last.block_hashes.append(key)
                        last.token_ids.extend(span or [])
                    else:
                        last = BlockStored([key], parents[i], list(span or []), block_size, medium).set_group(group)
                        events.append(last)
        elif kind == "removed":
            _, medium, keys, groups = item
            for group, positions in _by_group(groups, len(keys)):
                idx = None if group is None else group.idx
                last = _open_event(events, BlockRemoved, medium, idx)
                if isinstance(last, BlockRemoved):
                    last.block_hashes.extend(keys[i] for i in positions)
                elif positions:
                    events.append(BlockRemoved([keys[i] for i in positions], medium, idx))
        else:
            events.append(AllBlocksCleared())
    return events
