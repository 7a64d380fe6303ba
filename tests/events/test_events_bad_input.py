"""What the fuzz harnesses events_wire and events_replay found: payloads the decoder took but
could not write back, and a live batch of one boot applied over a snapshot of the next."""

from __future__ import annotations

import threading

import msgpack
import pytest
import zmq

from kvstore.events import Subscriber
from kvstore.events.replay_ring import snapshot_batches
from kvstore.events.wire import (
    END_SEQ,
    SNAPSHOT_REQUEST,
    BlockStored,
    EventBatch,
    WireError,
    decode_batch,
    encode_batch,
    seq_frame,
)

from waiting import wait_until

STORED = {"type": "BlockStored", "block_hashes": [b"k"], "block_size": 4}


@pytest.mark.parametrize("payload", [
    msgpack.packb([1.0, [{**STORED, "lora_id": msgpack.ExtType(5, b"x")}]]),  # re-encoded as [5, b"x"]
    msgpack.packb([1.0, [{**STORED, "locality": msgpack.Timestamp(1, 0)}]], datetime=False),  # not encodable
    msgpack.packb([1.0, [{**STORED, "extra_keys": [{msgpack.Timestamp(1, 0): 1}]}]], datetime=False),
    msgpack.packb([1.0, [], 0, {"epoch": 1, "media": {"GPU": {"dtype": msgpack.ExtType(1, b"")}}}]),
], ids=["ext", "timestamp", "timestamp-key", "ext-in-media"])
def test_the_decoder_refuses_msgpack_extensions(payload: bytes) -> None:
    """vLLM sends none; the decoder took them into fields the encoder then could not write
    back (a TypeError) or wrote back as something else."""
    with pytest.raises(WireError, match=r"msgpack (extension|timestamp)"):
        decode_batch(payload)


@pytest.mark.parametrize("ext", [{"snapshot": True}, {"media": {"GPU": {"a": 1}}}, {"epoch": 3, "media": {}}])
def test_every_extension_field_a_decoder_read_is_written_back(ext: dict[str, object]) -> None:
    """Without an epoch, the extension (and so ``snapshot`` or ``media``) used to be left out,
    and an empty ``media`` always was: a decoded batch did not survive its re-encoding."""
    batch = decode_batch(msgpack.packb([1.0, [], 0, ext]))
    assert decode_batch(encode_batch(batch)) == batch
    assert batch.snapshot == ext.get("snapshot", False) and batch.media == ext.get("media")


def test_a_live_batch_of_an_older_boot_than_the_snapshot_it_asked_for_is_not_applied() -> None:
    """The publisher restarts between a live batch (epoch 7, seq 5) and the snapshot that batch
    makes the subscriber ask for (epoch 8, as of seq 1). Applying the old batch over the new
    snapshot put a block of the dead process in the view and moved ``last_seq`` to 5, so that
    the new boot's seqs 2..5 were then dropped as duplicates."""
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    replay = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    old, new, later = b"o" * 32, b"n" * 32, b"l" * 32
    snapshot = snapshot_batches([("GPU", 4, [(new, None)])], 8, 0)
    stop = threading.Event()

    def serve() -> None:  # the restarted publisher's replay socket: its snapshot, no ring
        while not stop.is_set():
            if router.poll(20):
                envelope, _, request = router.recv_multipart()
                if request == SNAPSHOT_REQUEST:
                    for batch in snapshot:
                        router.send_multipart([envelope, b"", b"", seq_frame(1), encode_batch(batch)])
                router.send_multipart([envelope, b"", b"", END_SEQ, b""])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    sub = Subscriber(endpoint, replay_endpoint=replay, snapshot_on_start=False, request_timeout_s=2.0)
    try:
        stale = encode_batch(EventBatch(1.0, [BlockStored([old], None, [], 4, "GPU")], 0, epoch=7))

        def heard() -> bool:  # ZeroMQ's slow joiner: sent until the subscriber takes one
            pub.send_multipart([b"", seq_frame(5), stale])
            sub.poll(0.05)
            return sub.counters["snapshots"] > 0

        wait_until(heard, 30, lambda: f"the stale batch heard ({sub.stats()})", poll_s=0)
        assert sub.epoch == 8 and sub.last_seq == 1 and sub.sink.blocks("GPU") == {new}
        pub.send_multipart([b"", seq_frame(2), encode_batch(
            EventBatch(2.0, [BlockStored([later], new, [], 4, "GPU")], 0, epoch=8))])

        def applied() -> bool:
            sub.poll(0.05)
            return later in sub.sink.blocks("GPU")

        wait_until(applied, 30, lambda: f"the new boot's seq 2 applied ({sub.stats()})", poll_s=0)
        assert sub.sink.blocks("GPU") == {new, later} and sub.last_seq == 2 and not sub.approximate
    finally:
        stop.set()
        server.join()
        sub.close()
        pub.close(0)
        router.close(0)
        ctx.term()
