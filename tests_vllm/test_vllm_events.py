"""KV events against the pinned vLLM's own code (vllm.distributed.kv_events): its msgspec
types decode what kvstore's publisher sends (a hybrid model's KV groups included), kvstore
decodes what vLLM encodes, and the Subscriber follows vLLM's real ZmqEventPublisher, through
replay and across a restart (which vLLM tells by nothing but its seq starting again at 0)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch
import zmq
from vllm.distributed.kv_events import AllBlocksCleared as VCleared
from vllm.distributed.kv_events import BlockRemoved as VRemoved
from vllm.distributed.kv_events import BlockStored as VStored
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

from kvstore import StoreConfig, TieredStore
from kvstore.events import EventPublisher, EventsConfig, Subscriber, event_groups
from kvstore.events.store_events import StoreEvents
from kvstore.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)
from kvstore.layout import KVGroup, KVLayout
from tests.waiting import wait_until

K1, K2, K3 = b"\x11" * 32, b"\x22" * 32, b"\x33" * 32


def test_vllms_decoder_reads_kvstores_batches_and_kvstore_reads_vllms() -> None:
    ours = EventBatch(1.5, [BlockStored([K1, K2], None, list(range(8)), 4, "CPU"), BlockRemoved([K3], "GPU"),
                            AllBlocksCleared()], 0, epoch=2**64 - 1)  # the extension element too
    theirs = msgspec.msgpack.Decoder(type=KVEventBatch).decode(encode_batch(ours))
    assert theirs.ts == 1.5 and theirs.data_parallel_rank == 0
    stored, removed, cleared = theirs.events
    assert isinstance(stored, VStored) and stored.block_hashes == [K1, K2] and stored.parent_block_hash is None
    assert stored.token_ids == list(range(8)) and stored.block_size == 4 and stored.medium == "CPU"
    assert isinstance(removed, VRemoved) and removed.block_hashes == [K3] and removed.medium == "GPU"
    assert isinstance(cleared, VCleared)

    vllm_batch = KVEventBatch(ts=2.0, events=[
        VStored(block_hashes=[7, 8], parent_block_hash=6, token_ids=[1, 2], block_size=1, lora_id=None,
                medium="GPU", lora_name=None, locality="LOCAL", session_id="s"),
        VRemoved(block_hashes=[6], medium="GPU")], data_parallel_rank=1)
    back = decode_batch(msgspec.msgpack.Encoder().encode(vllm_batch))
    assert back.ts == 2.0 and back.data_parallel_rank == 1 and back.epoch is None
    assert back.events == [BlockStored([7, 8], 6, [1, 2], 1, "GPU", group_idx=None, kv_cache_spec_kind=None,
                                       locality="LOCAL", session_id="s"),
                           BlockRemoved([6], "GPU", group_idx=None)]  # what vLLM left out stays unset


def test_kvstores_publisher_is_read_by_a_consumer_written_against_vllms_types() -> None:
    with EventPublisher(EventsConfig("tcp://127.0.0.1:*", heartbeat_s=0.05)) as pub:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        try:
            seen: list[object] = []

            def decoded_a_block_stored() -> bool:  # published until one arrives (ZeroMQ's slow joiner)
                pub.stored("CPU", [K1], [None], 4, [1, 2, 3, 4])
                if sub.poll(100):
                    _topic, seq, payload = sub.recv_multipart()
                    assert int.from_bytes(seq, "big") >= 0
                    seen.extend(decoder.decode(payload).events)  # heartbeats decode too
                return any(isinstance(e, VStored) for e in seen)

            wait_until(decoded_a_block_stored, 30, "a BlockStored decoded", poll_s=0)
        finally:
            sub.close(0)
            ctx.term()


def test_a_consumer_on_vllms_own_types_reads_a_hybrid_publishers_groups() -> None:
    """A kvstore publisher of a hybrid layout (a full group and a sliding window of 64 tokens):
    the device side publishes blocks of both groups in one call, a real store's host tier puts
    and deletes blocks of each group. A consumer decoding with vLLM's KVEventBatch reads every
    batch and sees each block's group_idx, kv_cache_spec_kind and window."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32,
                      groups=(KVGroup("full", (0,)), KVGroup("sliding", (1,), window=64)))
    full, sliding = event_groups(layout)
    store = TieredStore(StoreConfig(layout, "vllm-events-test", host_bytes=1 << 20))
    with EventPublisher(EventsConfig("tcp://127.0.0.1:*", heartbeat_s=0.05)) as pub:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        events: list[object] = []
        try:
            def receive() -> int:  # every batch, heartbeats included, decodes with vLLM's types
                while sub.poll(50):
                    events.extend(decoder.decode(sub.recv_multipart()[2]).events)
                return len(events)

            wait_until(lambda: sub.poll(100), 30, "a heartbeat (ZeroMQ's slow joiner)", poll_s=0)
            StoreEvents(pub, store).attach()
            keys = store.block_keys(list(range(8)))
            group_keys = [store.group_keys(keys, g) for g in range(2)]
            pub.stored("GPU", [group_keys[0][0], group_keys[1][0]], [None, None], 4, [0, 1, 2, 3] * 2,
                       groups=[full, sliding])
            for g in range(2):
                store.put(group_keys[g], torch.zeros((2, *layout.block_shape)), group=g)
            store.delete(group_keys[1][:1])
            pub.removed("GPU", [group_keys[1][0]], group=sliding)

            def seen() -> bool:
                receive()
                removed = [e for e in events if isinstance(e, VRemoved)]
                return len(removed) == 2 and len([e for e in events if isinstance(e, VStored)]) == 4

            wait_until(seen, 30, lambda: f"the events ({events})", poll_s=0)
        finally:
            sub.close(0)
            ctx.term()
            store.close()
    fields = [(e.medium, e.block_hashes, e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
              for e in events if isinstance(e, VStored)]
    assert fields == [("GPU", [group_keys[0][0]], 0, "full_attention", None),
                      ("GPU", [group_keys[1][0]], 1, "sliding_window", 64),
                      ("CPU", group_keys[0], 0, "full_attention", None),
                      ("CPU", group_keys[1], 1, "sliding_window", 64)]
    assert [(e.medium, e.block_hashes, e.group_idx) for e in events if isinstance(e, VRemoved)] == [
        ("CPU", group_keys[1][:1], 1),  # a store names the group of what leaves it too
        ("GPU", group_keys[1][:1], 1)]
    # and vLLM's own encoder writes kvstore's bytes for them, group fields included
    ours = EventBatch(1.0, [BlockStored(group_keys[1], None, [], 4, "CPU").set_group(sliding),
                            BlockRemoved(group_keys[1][:1], "CPU", 1)], 0)
    theirs = KVEventBatch(ts=1.0, data_parallel_rank=0, events=[
        VStored(block_hashes=group_keys[1], parent_block_hash=None, token_ids=[], block_size=4, lora_id=None,
                medium="CPU", lora_name=None, group_idx=1, kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=64),
        VRemoved(block_hashes=group_keys[1][:1], medium="CPU", group_idx=1)])
    assert encode_batch(ours) == msgspec.msgpack.encode(theirs)


def _vllm_publisher(where: Path) -> ZmqEventPublisher:
    # vLLM binds a wildcard or ipc:// endpoint and connects to any other: ipc keeps it local
    return ZmqEventPublisher(0, endpoint=f"ipc://{where}/pub", replay_endpoint=f"ipc://{where}/replay",
                             buffer_steps=100)


def _stored(*keys: int, parent: int | None = None) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[VStored(block_hashes=list(keys), parent_block_hash=parent,
                                                        token_ids=[0] * len(keys), block_size=1, lora_id=None,
                                                        medium="GPU", lora_name=None)])


def _until(cond: Callable[[], bool], sub: Subscriber, timeout: float = 30.0) -> None:
    """Drive ``sub`` (each ``poll`` waits on its socket up to 50 ms) until ``cond()`` holds."""

    def check() -> bool:
        if cond():
            return True
        sub.poll(0.05)
        return False

    wait_until(check, timeout, lambda: f"the condition; subscriber {sub.stats()}", poll_s=0)


def test_subscriber_follows_vllms_publisher_by_replay_and_across_its_restart(tmp_path: Path) -> None:
    vpub = _vllm_publisher(tmp_path)
    sub = Subscriber(f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay", request_timeout_s=1.0)
    try:
        vpub.publish(_stored(1, 2))  # before the subscriber hears anything: replayed from seq 0
        time.sleep(0.3)  # ZeroMQ's slow joiner: vLLM's PUB socket tells nobody when a subscriber joined
        sub.poll(0.3)  # vLLM answers the snapshot request with the end marker alone
        for _ in range(30):  # seq 1..30: the restarted one is told apart while its seq is lower
            vpub.publish(_stored(3, parent=2))
        _until(lambda: sub.sink.blocks("GPU") == {1, 2, 3} and sub.last_seq == 30, sub)
        assert sub.stats()["snapshots"] == 0 and sub.stats()["epoch"] is None and not sub.approximate
        vpub.shutdown()

        vpub = _vllm_publisher(tmp_path)  # a restarted vLLM: seq 0 again, nothing of the old one stands

        def restart_seen() -> int:  # ZeroMQ reconnects on its own time: published until it is seen
            if not sub.stats()["restarts"]:
                vpub.publish(_stored(9))
                sub.poll(0.2)
            return sub.stats()["restarts"]

        wait_until(restart_seen, 30, lambda: f"the restart seen ({sub.stats()})", poll_s=0)
        _until(lambda: sub.sink.blocks("GPU") == {9}, sub)
        assert not sub.approximate
    finally:
        sub.close()
        vpub.shutdown()
