"""Publisher and Subscriber over real ZeroMQ sockets: live stream, replay after a dropped
connection, snapshot past the ring, drops under a full queue, heartbeats and staleness."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import zmq

from kvstore.events import EventPublisher, EventsConfig, Subscriber
from kvstore.events.wire import (
    END_SEQ,
    SNAPSHOT_REQUEST,
    AllBlocksCleared,
    BlockStored,
    decode_batch,
    parse_seq,
    seq_frame,
)

from events_helpers import until
from waiting import wait_until


class Tier:
    """A fake tier's truth: key -> parent, published as it changes (the snapshot source)."""

    def __init__(self, pub: EventPublisher, medium: str = "GPU") -> None:
        self.pub, self.medium, self.held = pub, medium, {}
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when the publisher thread calls the source
        self._n = 0
        pub.add_source(self.source)

    def source(self) -> list[tuple[str, int, list[tuple[bytes, bytes | None]]]]:
        self.entered.set()
        self.gate.wait(10)
        return [(self.medium, 4, list(self.held.items()))]

    def store(self, n: int) -> list[bytes]:
        keys = [(self._n + i).to_bytes(4, "big") * 8 for i in range(n)]
        self._n += n
        parents = [None, *keys[:-1]]
        self.held.update(zip(keys, parents, strict=True))
        self.pub.stored(self.medium, keys, parents, 4, list(range(4 * n)))
        return keys

    def remove(self, keys: list[bytes]) -> None:
        for k in keys:
            del self.held[k]
        self.pub.removed(self.medium, keys)


@pytest.fixture
def pub() -> EventPublisher:
    p = EventPublisher(EventsConfig("tcp://127.0.0.1:*", heartbeat_s=0.1, buffer_batches=64))
    yield p
    p.close()


def sent(pub: EventPublisher) -> None:
    """Returns once the publisher's thread took everything queued into a batch: what is
    published next is a batch of its own."""
    wait_until(lambda: pub.stats()["queued"] == 0, 10, "the publisher taking what is queued")


def _sub(pub: EventPublisher, **kwargs: object) -> Subscriber:
    return Subscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint or "", **kwargs)  # type: ignore[arg-type]


def test_live_stream_builds_the_view_and_merges_chains(pub: EventPublisher) -> None:
    tier = Tier(pub)
    seen: list[tuple[int, object, str]] = []
    with _sub(pub, on_batch=lambda s, b, src: seen.append((s, b, src))) as sub:
        until(lambda: sub.stats()["snapshots"] == 1, sub)
        a = tier.store(3)
        tier.store(2)
        tier.remove(a[1:])
        until(lambda: sub.sink.blocks("GPU") == set(tier.held), sub)
        assert not sub.approximate and sub.stats()["gaps"] == 0
    stored = [e for _, batch, src in seen if src == "live" for e in batch.events if isinstance(e, BlockStored)]
    assert stored[0].block_hashes == a and stored[0].parent_block_hash is None  # one event per chain run
    assert stored[0].token_ids == list(range(12)) and stored[0].medium == "GPU"


def test_dropped_connection_catches_up_by_replay(pub: EventPublisher) -> None:
    tier = Tier(pub)
    with _sub(pub) as sub:
        tier.store(2)
        until(lambda: sub.sink.blocks("GPU") == set(tier.held), sub)
        sub.pause()
        for _ in range(5):
            tier.remove([next(iter(tier.held))]) if len(tier.held) > 3 else tier.store(2)
            sent(pub)
        beats = pub.stats()["heartbeats"]
        wait_until(lambda: pub.stats()["heartbeats"] >= beats + 2, 10, "heartbeats going by unseen")
        sub.resume()
        until(lambda: sub.sink.blocks("GPU") == set(tier.held) and sub.stats()["replays"] >= 1, sub)
        s = sub.stats()
        assert s["gaps"] >= 1 and s["snapshots"] == 1 and not sub.approximate  # only the start snapshot


def test_gap_older_than_the_ring_takes_a_snapshot() -> None:
    with EventPublisher(EventsConfig("tcp://127.0.0.1:*", heartbeat_s=0.05, buffer_batches=4)) as pub:
        tier = Tier(pub, "CPU")
        with _sub(pub) as sub:
            until(lambda: sub.stats()["snapshots"] == 1, sub)
            sub.pause()
            for _ in range(8):
                tier.store(1)
                sent(pub)  # one batch each, more than the ring keeps
            sub.resume()
            until(lambda: sub.stats()["snapshots"] == 2, sub)
            until(lambda: sub.sink.blocks("CPU") == set(tier.held), sub)
            assert sub.stats()["replays"] >= 1


def test_full_queue_drops_and_counts_without_blocking_then_consumers_resync() -> None:
    with EventPublisher(EventsConfig("tcp://127.0.0.1:*", queue_size=10, heartbeat_s=0.1)) as pub:
        tier = Tier(pub)
        with _sub(pub) as sub:
            until(lambda: sub.stats()["snapshots"] == 1, sub)
            tier.gate.clear()  # the publisher thread will hang in the next snapshot it serves
            ctx = zmq.Context.instance()
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(pub.replay_endpoint)
            tier.entered.clear()
            dealer.send_multipart([b"", SNAPSHOT_REQUEST])
            assert tier.entered.wait(10), "the publisher thread never served the snapshot"
            t0 = time.perf_counter()
            accepted = [pub.stored("GPU", [i.to_bytes(4, "big") * 8], [None], 4) for i in range(100, 200)]
            elapsed = time.perf_counter() - t0
            for i in range(100, 200):
                tier.held[i.to_bytes(4, "big") * 8] = None
            assert elapsed < 2.0, f"100 events took {elapsed:.3f} s with the publisher thread stuck"
            assert sum(accepted) == 10 and pub.stats()["dropped_events"] == 90
            tier.gate.set()
            dealer.close(linger=0)
            until(lambda: sub.sink.blocks("GPU") == set(tier.held), sub)
            assert sub.stats()["snapshots"] == 2 and sub.stats()["unfilled_gaps"] == 0


def test_heartbeats_when_idle_and_staleness_when_they_stop() -> None:
    pub = EventPublisher(EventsConfig("tcp://127.0.0.1:*", heartbeat_s=0.05))
    tier = Tier(pub)
    tier.store(2)
    with _sub(pub, heartbeat_timeout_s=0.4) as sub:
        until(lambda: sub.stats()["snapshots"] == 1 and len(sub.sink) == 2, sub)
        first = sub.last_seq
        until(lambda: (sub.last_seq or 0) >= (first or 0) + 5, sub)  # only heartbeats went by
        assert pub.stats()["heartbeats"] >= 5 and not sub.approximate and len(sub.sink) == 2
        pub.close()
        until(lambda: sub.sink.held() == {}, sub)  # a clean shutdown ends with AllBlocksCleared
        time.sleep(0.5)  # past heartbeat_timeout_s with no heartbeat: the staleness under test
        sub.poll(0.0)
        assert sub.approximate


def test_a_plain_vllm_style_consumer_reads_the_stream_and_the_replay() -> None:
    """Raw sockets, as vLLM's example subscriber uses them: SUB for three frames, then a
    replay request from a start seq answered by (topic, seq, payload) messages and the end
    marker, as vLLM 0.32 answers."""
    import vllm_types as v

    with EventPublisher(EventsConfig("tcp://127.0.0.1:*", topic="kv", heartbeat_s=60)) as pub:
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        for _ in range(100):  # until the SUB socket has joined (ZeroMQ's slow joiner)
            pub.stored("CPU", [b"\x01" * 32], [None], 16)
            if sub.poll(200):
                break
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        batch = v.msgspec.msgpack.Decoder(v.KVEventBatch).decode(payload)
        assert batch.events[0].block_hashes == [b"\x01" * 32] and batch.events[0].medium == "CPU"
        req = ctx.socket(zmq.DEALER)
        req.connect(pub.replay_endpoint)
        req.send_multipart([b"", seq_frame(0)])
        replies = []
        while True:
            assert req.poll(5000)
            _, rtopic, rseq, rpayload = req.recv_multipart()
            if rseq == END_SEQ:
                assert rpayload == b"" and rtopic == b""
                break
            assert rtopic == b"kv"
            replies.append((parse_seq(rseq), decode_batch(rpayload)))
        assert [s for s, _ in replies] == list(range(parse_seq(seq) + 1))  # from seq 0, the opening clear
        assert replies[0][1].events == [AllBlocksCleared()]
        for s in (sub, req):
            s.close(linger=0)


def test_bad_endpoints_and_busy_ports_are_config_errors(pub: EventPublisher) -> None:
    from kvstore.errors import ConfigError

    with pytest.raises(ConfigError, match="must start with"):
        EventsConfig("http://127.0.0.1:5557")
    with pytest.raises(ConfigError, match="cannot bind"):
        EventPublisher(EventsConfig(pub.endpoint))
    assert EventsConfig("tcp://127.0.0.1:5557").replay_endpoint == "tcp://127.0.0.1:5558"
    assert EventsConfig("ipc:///tmp/kv").replay_endpoint == "ipc:///tmp/kv-replay"
    assert EventsConfig("tcp://127.0.0.1:5557", "").replay_endpoint == ""
    # a port out of range is refused (ZeroMQ bound such an endpoint to some free port, and
    # the daemon announced that one: subscribers told the port asked for found nothing)
    for bad, why in (("tcp://127.0.0.1:99999", "port 99999 .* is not in 1-65535"),
                     ("tcp://127.0.0.1:0", "port 0 .* is not in 1-65535"),
                     ("tcp://127.0.0.1", "a tcp endpoint is tcp://HOST:PORT"),
                     ("tcp://127.0.0.1:65535", "would take the next port")):
        with pytest.raises(ConfigError, match=why):
            EventsConfig(bad)
    with pytest.raises(ConfigError, match="replay_endpoint: port 70000"):
        EventsConfig("tcp://127.0.0.1:5557", "tcp://127.0.0.1:70000")
    assert EventsConfig("tcp://127.0.0.1:65535", "tcp://127.0.0.1:6000").replay_endpoint == "tcp://127.0.0.1:6000"


def test_garbage_on_the_replay_socket_changes_nothing(pub: EventPublisher) -> None:
    tier = Tier(pub)
    ctx = zmq.Context.instance()
    bad = ctx.socket(zmq.DEALER)
    bad.connect(pub.replay_endpoint)
    for frames in ([b"", b"short"], [b"x", b"y", b"z", b"w"], [b"", b"\x00" * 9], [b"", SNAPSHOT_REQUEST + b"!"]):
        bad.send_multipart(frames)
    with _sub(pub) as sub:
        tier.store(3)
        until(lambda: sub.sink.blocks("GPU") == set(tier.held), sub)
    replies = []
    while bad.poll(200):
        replies.append(bad.recv_multipart())
    # a 2- or 3-frame request of the wrong size gets just the end marker; the 4-frame one nothing
    assert replies and all(r[-2:] == [END_SEQ, b""] for r in replies) and len(replies) == 3
    assert pub.stats()["invalid_requests"] == 4
    bad.close(linger=0)


def _kvstore_events_json(pub: EventPublisher, *args: str) -> list[dict[str, Any]]:
    """Run ``kvstore events --json ARGS`` against ``pub`` (a DISK tier storing a block every
    0.2 s until it exits); the batches it printed."""
    import json
    import subprocess
    import sys

    tier = Tier(pub, "DISK")
    tier.store(2)
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "events", pub.endpoint, "--replay-endpoint",
                             str(pub.replay_endpoint), "--json", "--timeout", "30", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(100):  # keep publishing, a block every 0.2 s, until it has seen enough (it may start late)
        tier.store(1)
        try:
            proc.wait(0.2)
            break
        except subprocess.TimeoutExpired:
            pass
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_kvstore_events_prints_the_stream(pub: EventPublisher) -> None:
    docs = _kvstore_events_json(pub, "--snapshot", "--count", "4")
    snap = [d for d in docs if d["source"] == "snapshot"]
    assert snap and snap[0]["events"] == [{"type": "AllBlocksCleared"}] and snap[0]["epoch"] == pub.epoch
    stored = [e for d in snap for e in d["events"] if e["type"] == "BlockStored"]
    assert stored[0]["medium"] == "DISK" and len(stored[0]["block_hashes"][0]) == 64  # full 32-byte keys, hex
    assert any(d["source"] == "live" and d["events"] for d in docs)


def test_kvstore_events_names_an_endpoint_it_cannot_use() -> None:
    import subprocess
    import sys

    from kvstore.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot connect to the event endpoint 'not-an-endpoint'"):
        Subscriber("not-an-endpoint")
    with pytest.raises(ConfigError, match="cannot connect to the replay endpoint 'bogus'"):
        Subscriber("tcp://127.0.0.1:5999", replay_endpoint="bogus")  # at once, not at its first request
    for args, message in ((["not-an-endpoint"], "cannot connect to the event endpoint 'not-an-endpoint'"),
                          (["tcp://nohost"], "a tcp endpoint is tcp://HOST:PORT (PORT a number or *), got 'tcp://nohost'"),
                          (["tcp://127.0.0.1:5999", "--replay-endpoint", "bogus", "--timeout", "1"],
                           "cannot connect to the replay endpoint 'bogus'")):
        proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "events", *args], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_replay_ring_keeps_the_newest_within_its_count_and_bytes() -> None:
    from kvstore.events.replay_ring import ReplayRing

    ring = ReplayRing(capacity=4, max_bytes=100)
    for seq in range(6):
        ring.append(seq, b"x" * 10)
    assert [s for s, _ in ring.since(0)] == [2, 3, 4, 5] and ring.num_bytes == 40
    ring.append(6, b"y" * 80)  # over the byte cap: the oldest go until it fits
    assert [s for s, _ in ring.since(0)] == [4, 5, 6] and ring.num_bytes == 100
    ring.append(7, b"z" * 500)  # a batch larger than the cap is still kept, alone
    assert [s for s, _ in ring.since(6)] == [7]


def test_callback_sink_and_fan_out_see_what_the_view_sees(pub: EventPublisher) -> None:
    from kvstore.events import CallbackSink, EventView, FanOut

    tier = Tier(pub, "CPU")
    tier.store(4)
    mirror: dict[str, set[bytes]] = {}
    calls: list[str] = []

    def stored(keys: list[bytes], medium: str) -> None:
        calls.append("stored")
        mirror.setdefault(medium, set()).update(keys)

    def removed(keys: list[bytes], medium: str) -> None:
        calls.append("removed")
        mirror.get(medium, set()).difference_update(keys)

    def cleared() -> None:
        calls.append("cleared")
        mirror.clear()

    view = EventView()
    with Subscriber(pub.endpoint, FanOut(view, CallbackSink(stored, removed, cleared)),
                    replay_endpoint=pub.replay_endpoint or "") as sub:
        until(lambda: sub.stats()["snapshots"] == 1, sub)
        assert calls[:2] == ["cleared", "stored"]  # a snapshot is a clear, then stores
        tier.remove(list(tier.held)[:2])
        tier.store(1)
        until(lambda: view.blocks("CPU") == set(tier.held), sub)
        assert {m: k for m, k in mirror.items() if k} == view.held() and "removed" in calls


class VllmStylePublisher:
    """A publisher as vLLM runs one: PUB + ROUTER, batches from vLLM's own msgspec types, no
    epoch, no heartbeats, a replay that answers any request it cannot read with the end marker.
    Replies are (topic, seq, payload) as from vLLM 0.32, or (seq, payload) as from earlier
    versions with ``topic_in_replay=False``."""

    def __init__(self, topic_in_replay: bool = True) -> None:
        self.head = [b""] if topic_in_replay else []
        import vllm_types

        self.v = vllm_types
        self.ctx = zmq.Context()
        # XPUB: a PUB to its subscribers, which also hands over their subscriptions (wait_subscribed)
        self.pub, self.router = self.ctx.socket(zmq.XPUB), self.ctx.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.replay_endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.ring: list[tuple[int, bytes]] = []

    def publish(self, *events: object) -> None:
        payload = self.v.msgspec.msgpack.encode(self.v.KVEventBatch(ts=time.time(), events=list(events),
                                                                     data_parallel_rank=0))
        seq = len(self.ring)
        self.ring.append((seq, payload))
        self.pub.send_multipart([b"", seq_frame(seq), payload])

    def wait_subscribed(self, timeout_s: float = 10.0) -> None:
        """Returns once a subscription reached this publisher: its subscriber gets what is
        published from then on (ZeroMQ drops what a PUB sends before: the slow joiner)."""
        assert self.pub.poll(int(timeout_s * 1000)), f"no subscription in {timeout_s} s"
        self.pub.recv()

    def serve(self) -> None:
        while self.router.poll(0):
            ident, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in self.ring:
                if seq >= first:
                    self.router.send_multipart([ident, b"", *self.head, seq_frame(seq), payload])
            self.router.send_multipart([ident, b"", *self.head, END_SEQ, b""])

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


@pytest.mark.parametrize("topic_in_replay", [True, False], ids=["vllm-0.32", "vllm-before-0.32"])
def test_subscriber_follows_a_plain_vllm_publisher_by_replay_from_seq_0(topic_in_replay: bool) -> None:
    vp = VllmStylePublisher(topic_in_replay)
    v = vp.v
    try:
        vp.publish(v.VStored([1, 2], None, list(range(32)), 16, None, None, None))
        vp.publish(v.VStored([3], 2, list(range(16)), 16, None, "GPU", None), v.VRemoved([1], None))
        sub = Subscriber(vp.endpoint, replay_endpoint=vp.replay_endpoint, request_timeout_s=0.5)
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                if vp.router.poll(50):  # a request came
                    vp.serve()

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        try:
            sub.poll(0.3)  # asks for a snapshot: a vLLM publisher answers only the end marker
            vp.wait_subscribed()  # ZeroMQ's slow joiner: live batches reach it from now on
            vp.publish(v.VRemoved([3], "GPU"), v.VStored([4], 2, list(range(16)), 16, None, "GPU", None))
            until(lambda: sub.sink.blocks("GPU") == {2, 4}, sub)
            s = sub.stats()
            assert s["snapshots"] == 0 and s["replays"] == 1 and s["epoch"] is None and not sub.approximate
        finally:
            stop.set()
            server.join()
            sub.close()
    finally:
        vp.close()


def _raw_publisher() -> tuple[zmq.Context, zmq.Socket, str]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    return ctx, sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def test_garbage_on_the_live_stream_is_counted_and_the_thread_follows_on() -> None:
    """A payload msgpack itself chokes on (a map keyed by an array raises TypeError there)
    is a decode error; the background thread stays up and applies the next batches."""
    from kvstore.events.wire import EventBatch, encode_batch

    ctx, raw, endpoint = _raw_publisher()
    try:
        with Subscriber(endpoint).start() as sub:
            first = encode_batch(EventBatch(1.0, [BlockStored([b"a" * 32], None, [], 4, "CPU")], 0))

            def landed() -> int:  # ZeroMQ's slow joiner: sent until the first lands
                raw.send_multipart([b"", seq_frame(0), first])
                return sub.stats()["batches"]

            wait_until(landed, 30, lambda: f"the first batch landing ({sub.stats()})", poll_s=0.05)
            raw.send_multipart([b"", seq_frame(1), bytes.fromhex("9301918191010100")])
            raw.send_multipart([b"", seq_frame(2), encode_batch(EventBatch(
                2.0, [BlockStored([b"b" * 32], None, [], 4, "CPU")], 0))])
            wait_until(lambda: sub.sink.blocks("CPU") == {b"a" * 32, b"b" * 32}, 30,
                       lambda: f"both blocks applied ({sub.stats()})")
            assert sub._thread is not None and sub._thread.is_alive()
            s = sub.stats()
            assert s["decode_errors"] == 1 and s["errors"] == 0
            assert sub.approximate  # seq 1 never came: a gap nothing (no replay here) could fill
    finally:
        raw.close(0)
        ctx.term()


def test_a_failing_snapshot_source_keeps_the_publisher_up_and_the_subscriber_retries() -> None:
    with EventPublisher(EventsConfig("tcp://127.0.0.1:*", heartbeat_s=0.05, buffer_batches=4)) as pub:
        tier = Tier(pub, "CPU")
        broken = threading.Event()
        broken.set()

        def closing_store() -> list[tuple[str, int, list[tuple[bytes, bytes | None]]]]:
            if broken.is_set():
                raise RuntimeError("the store is closing")
            return []

        pub.add_source(closing_store)
        for _ in range(8):  # more batches than the ring keeps: only a snapshot can sync
            tier.store(1)
            sent(pub)
        with _sub(pub, request_timeout_s=0.3) as sub:
            until(lambda: pub.stats()["snapshot_errors"] >= 2 and sub.stats()["unfilled_gaps"] >= 1, sub)
            assert sub.approximate and sub.stats()["snapshots"] == 0
            heartbeats = pub.stats()["heartbeats"]
            until(lambda: pub.stats()["heartbeats"] > heartbeats, sub)  # its thread is still publishing
            broken.clear()
            until(lambda: sub.stats()["snapshots"] == 1 and not sub.approximate, sub)  # tried again
            until(lambda: sub.sink.blocks("CPU") == set(tier.held), sub)


def test_a_restarted_publisher_without_an_epoch_clears_the_view() -> None:
    """vLLM sends no epoch: its restart shows as a live seq going back to 0. What the old
    process held is gone, and the new one's batches are not taken for duplicates."""
    vp = VllmStylePublisher()
    v = vp.v
    try:
        sub = Subscriber(vp.endpoint)  # no replay: a restart must show on the live stream alone

        def old_process_landed() -> bool:  # the slow joiner: published until the old process's land
            if sub.sink.blocks("GPU") == {1, 2, 3}:
                return True
            vp.ring.clear()
            vp.publish(v.VStored([1, 2], None, list(range(32)), 16, None, "GPU", None))
            vp.publish(v.VStored([3], 2, list(range(16)), 16, None, "GPU", None))
            sub.poll(0.1)
            return False

        wait_until(old_process_landed, 30, lambda: f"the old process's blocks ({sub.stats()})", poll_s=0)
        before = sub.stats()["restarts"]
        vp.ring.clear()  # the new process starts at seq 0
        vp.publish(v.VStored([7], None, list(range(16)), 16, None, "GPU", None))
        until(lambda: sub.sink.blocks("GPU") == {7}, sub)
        s = sub.stats()
        assert s["restarts"] == before + 1 and s["duplicates"] == 0
        sub.close()
    finally:
        vp.close()


def test_kvstore_events_prints_no_snapshot_unless_asked(pub: EventPublisher) -> None:
    docs = _kvstore_events_json(pub, "--count", "2")
    assert len(docs) == 2 and all(d["source"] != "snapshot" and d["events"] for d in docs), docs


def test_snapshot_batches_hold_at_most_a_chunk_of_hashes() -> None:
    from kvstore.events.replay_ring import SNAPSHOT_CHUNK, snapshot_batches

    chains = []
    for length in (1000, 1000, 3, 2500, 1):  # runs that would overfill a batch
        keys = [os.urandom(32) for _ in range(length)]
        chains += list(zip(keys, [None, *keys[:-1]], strict=True))
    batches = snapshot_batches([("CPU", 16, chains)], epoch=1, rank=0)
    sizes = [sum(len(e.block_hashes) for e in b.events if isinstance(e, BlockStored)) for b in batches[1:]]
    assert max(sizes) <= SNAPSHOT_CHUNK and sum(sizes) == len(chains)
    assert batches[0].events == [AllBlocksCleared()] and all(b.snapshot for b in batches)


def test_a_burst_leaves_in_full_batches_back_to_back() -> None:
    """1,000 items queued at once with ``max_batch_events=10``: batches of at most ten, in a tick
    or two of the publisher, not one batch a tick (which took 100 ticks of 5 ms, and dropped a
    burst that outran it once the queue filled)."""
    with EventPublisher(EventsConfig("tcp://127.0.0.1:*", heartbeat_s=60, max_batch_events=10)) as pub:
        seen: list[Any] = []
        with _sub(pub, on_batch=lambda s, b, src: seen.append(b) if src == "live" else None) as sub:
            sub.poll(0.3)
            keys = [i.to_bytes(4, "big") * 8 for i in range(1000)]
            for k in keys:
                pub.stored("CPU", [k], [None], 16)
            until(lambda: len(sub.sink.blocks("CPU")) == 1000, sub)
            assert sub.stats()["gaps"] == 0
    batches = [b for b in seen if any(isinstance(e, BlockStored) for e in b.events)]
    sizes = [len(b.events) for b in batches]
    assert sum(sizes) == 1000 and max(sizes) == 10  # the producer may straddle a tick or two
    assert len(batches) < 110
    span = batches[-1].ts - batches[0].ts
    assert span < 0.25, f"the burst took {span * 1e3:.0f} ms to leave (100 ticks would be >= 500 ms)"
