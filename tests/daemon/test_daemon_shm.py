"""The shared-memory path: lock-free reads of slots named by earlier replies, checked by slot
generations, and the standing write lease that makes a put one round trip.

The race tests force the case the generation check exists for: while a client copies a slot
without a lease, another connection makes the daemon evict the block and reuse its slot for
other bytes. The copy must then never be returned as the block.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout
from kvstore.client import channel as client_module
from kvstore.client.client import StoreClient
from kvstore.client.pool_map import MappedPool
from kvstore.protocol import Code, RemoteError
from kvstore.tiers.host import PayloadViews

from daemon_helpers import LAYOUT, DaemonProc, blocks, prompt
from factories import run_in_threads
from waiting import wait_until

pytestmark = pytest.mark.skipif(not MappedPool.lock_free(), reason="lock-free reads need x86-64 (leases only)")
PAYLOAD = LAYOUT.bytes_per_block


class CopyCounter:
    """Wraps ``PayloadViews.read`` (a client's copy out of the mapped pool): counts reads from
    the pool, and runs ``midway`` once, after the first half of a read's rows are copied and
    before the rest are."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads = 0
        self.midway: object = None
        self.raw: torch.Tensor | None = None  # what the raced copy produced
        orig = PayloadViews.read

        def read(views: PayloadViews, slots: list[int], rows: torch.Tensor, non_blocking: bool = False) -> None:
            self.reads += 1
            midway, self.midway = self.midway, None
            if midway is None:
                return orig(views, slots, rows)
            half = len(slots) // 2
            orig(views, slots[:half], rows[:half])
            midway()  # type: ignore[operator]
            orig(views, slots[half:], rows[half:])
            self.raw = rows.clone()
            return None

        monkeypatch.setattr(PayloadViews, "read", read)


def count_calls(monkeypatch: pytest.MonkeyPatch, client: StoreClient) -> list[str]:
    """The ops of the requests ``client`` makes and waits for, appended as they are made."""
    ops: list[str] = []
    real_call = client._channel.call

    def counting_call(meta: dict, *args: object, **kwargs: object) -> object:
        ops.append(meta["op"])
        return real_call(meta, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(client._channel, "call", counting_call)
    return ops


def small_daemon(tmp_path: Path) -> DaemonProc:
    # 16 host slots of one page each, no disk: an evicted block is gone, its slot reused
    return DaemonProc(tmp_path / "data", "--max-namespaces", "1", host_mem="64KiB", disk="0")


def test_get_reuses_slots_from_earlier_replies_without_a_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = small_daemon(tmp_path)
    try:
        with d.connect(shm=True) as c:
            copies = CopyCounter(monkeypatch)
            keys = c.block_keys(prompt(1, 4))
            c.put(keys, blocks(keys))  # its write lease named the slots
            calls = count_calls(monkeypatch, c)
            for _ in range(3):
                assert torch.equal(c.get(keys), blocks(keys))
            assert copies.reads == 3 and calls == []  # no round trip at all
            # the daemon hears of the reads later, batched (touches count as reads)
            wait_until(lambda: c.daemon_stats()["tenant"]["get_blocks"] >= 12, 10, "the reads reported")
            assert c.daemon_stats()["tenant"]["get_blocks"] == 12
    finally:
        d.stop()


def test_a_read_lease_names_its_slots_for_later_lock_free_reads(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    d = small_daemon(tmp_path)
    try:
        with d.connect(shm=True) as reader, d.connect(shm=False) as writer:
            keys = writer.block_keys(prompt(3, 4))
            writer.put(keys, blocks(keys))  # over the socket: the reader knows no slot yet
            copies = CopyCounter(monkeypatch)
            ops = count_calls(monkeypatch, reader)
            assert torch.equal(reader.get(keys), blocks(keys))
            assert ops == ["get"]  # a lease: the reader read the held slots' generations
            assert torch.equal(reader.get(keys), blocks(keys))
            assert ops == ["get"] and copies.reads == 2  # the second copy took no lease
            # once the daemon frees those slots (generation bumped), the remembered ones are stale
            writer.delete(keys)
            writer.put(keys, blocks(keys))
            assert torch.equal(reader.get(keys), blocks(keys))
            assert ops == ["get", "get"]
    finally:
        d.stop()


@pytest.mark.parametrize("then", ["evicted", "evicted and put again"])
def test_a_slot_reused_during_a_lock_free_copy_is_never_returned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 then: str) -> None:
    d = small_daemon(tmp_path)
    try:
        with d.connect(shm=True) as reader, d.connect(shm=False) as writer:
            copies = CopyCounter(monkeypatch)
            keys = reader.block_keys(prompt(2, 4))
            reader.put(keys, blocks(keys))
            expected = blocks(keys)

            def evict_and_reuse() -> None:
                # 5 x 8 new blocks through a 16-slot pool: every older block is evicted and
                # its slot rewritten with other bytes, while the reader is mid-copy
                for r in range(5):
                    others = writer.block_keys(prompt(100 + r, 8))
                    writer.put(others, blocks(others))
                if then == "evicted and put again":
                    writer.put(keys, expected)  # same tenant, same keys: the same bytes again

            copies.midway = evict_and_reuse
            if then == "evicted":
                with pytest.raises(KeyError):
                    reader.get(keys)
                assert copies.raw is not None
                raw = copies.raw.view(torch.uint8).reshape(len(keys), PAYLOAD)
                want = expected.view(torch.uint8).reshape(len(keys), PAYLOAD)
                # the race really happened: the lock-free copy holds other bytes in some row
                assert any(not torch.equal(raw[i], want[i]) for i in range(len(keys)))
                assert copies.reads == 1  # and then no lease could find the blocks
            else:
                assert torch.equal(reader.get(keys), expected)
                assert copies.raw is not None
                assert copies.reads == 2  # the raced copy was dropped; a lease copied again
    finally:
        d.stop()


def test_a_run_of_puts_pays_no_round_trip_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = DaemonProc(tmp_path / "data", "--max-namespaces", "1", host_mem="1MiB", disk="0")
    try:
        with d.connect(shm=True) as c:
            chains = [c.block_keys(prompt(10 + r, 8)) for r in range(4)]
            wire: list[str] = []  # what the client sent, and when it waited for a reply
            real_encode, real_recv = client_module.encode, c._channel.recv_reply

            def recording_encode(meta: dict, *args: object) -> bytes:
                wire.append(meta["op"])
                return real_encode(meta, *args)  # type: ignore[arg-type]

            def recording_recv(request_id: int) -> object:
                wire.append("wait")
                return real_recv(request_id)

            monkeypatch.setattr(client_module, "encode", recording_encode)
            monkeypatch.setattr(c._channel, "recv_reply", recording_recv)
            for keys in chains:
                c.put(keys, blocks(keys))
            # the first put reserves its slots and the next put's; each commit reserves the
            # put's after next, and its reply is read only after the next put's copy
            assert wire == ["reserve", "wait", "commit", "wait", "commit", "wait", "commit", "wait", "commit"]
            c.flush()
            assert wire[-1] == "wait"
            for keys in chains:
                assert torch.equal(c.get(keys), blocks(keys))
            odd = c.block_keys(prompt(20, 3))  # another size: the standing lease goes back
            c.put(odd, blocks(odd))
            assert torch.equal(c.get(odd), blocks(odd))
        with d.connect(shm=True) as c:
            keys = c.block_keys(prompt(30, 8))
            c.put(keys, blocks(keys))
            # 43 blocks held; the slots in use add this connection's two standing leases of 8
            # (reserved, no block yet), while the first connection's standing ones went with it
            # the daemon ends a closed connection's leases as it notices
            wait_until(lambda: c.stats()["host"]["used_bytes"] == (43 + 16) * 4096, 10,
                       "the first connection's standing leases ended")
            host = c.stats()["host"]
            assert host["num_blocks"] == 4 * 8 + 3 + 8 and host["used_bytes"] == (43 + 16) * 4096, host
    finally:
        d.stop()


def test_commit_rejects_keys_that_do_not_match_its_lease(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "data", "--max-namespaces", "1", host_mem="1MiB", disk="0")
    try:
        with d.connect(shm=True) as c:
            keys = c.block_keys(prompt(40, 4))
            lease = c._call({"op": "reserve", "keys": c._keys_blob(keys)})[0]["lease"]
            with pytest.raises(RemoteError) as info:
                c._call({"op": "commit", "lease": lease, "keys": c._keys_blob(keys[:3])})
            assert info.value.code == Code.BAD_REQUEST
            assert c.stats()["host"]["num_blocks"] == 0
    finally:
        d.stop()


def test_past_the_lease_deadline_nothing_unwritten_is_published_or_returned(tmp_path: Path) -> None:
    # a lease of 0.2 ms: every deadline (half of it) passes before the client copies, so
    # puts and gets fall back to the socket; before, a put past its deadline still committed
    # its unwritten slots, and a get past its deadline returned rows it never copied
    d = DaemonProc(tmp_path / "data", "--max-namespaces", "1", "--lease-s", "0.0002", host_mem="1MiB", disk="0")
    try:
        with d.connect(shm=True) as c, d.connect(shm=False) as other:
            for r in range(4):
                keys = c.block_keys(prompt(50 + r, 6))
                c.put(keys, blocks(keys))
                assert torch.equal(other.get(keys), blocks(keys))  # what was published is the bytes put
                assert torch.equal(c.get(keys), blocks(keys))
    finally:
        d.stop()


def test_a_commit_the_daemon_refuses_is_never_published(tmp_path: Path) -> None:
    """A put returns before its commit's reply: a refused commit surfaces at the client's next
    request: an expired lease as a counted loss, anything else as an error naming the put;
    either way its blocks are misses, never other bytes."""
    d = DaemonProc(tmp_path / "data", "--max-namespaces", "1", host_mem="1MiB", disk="0")
    try:
        with d.connect(shm=True) as c:
            keys = c.block_keys(prompt(60, 4))
            # a lease the daemon no longer knows (as after a stall past lease_s): the bytes go
            # into free slots at the pool's end, the commit is refused with LEASE
            c._writes.leases.append((10**9, [250, 251, 252, 253], time.monotonic() + 60))
            c.put(keys, blocks(keys))
            assert c.num_lost_puts == 0  # not known yet: the reply has not been read
            assert c.lookup(keys).num_blocks == 0 and c.num_lost_puts == 4
            # a lease of 4 slots committed under 5 keys: BAD_REQUEST, raised by the next call
            five = c.block_keys(prompt(61, 5))
            lease = c._call({"op": "reserve", "keys": c._keys_blob(five[:4])})[0]
            c._writes.leases.clear()
            c._writes.leases.append((lease["lease"], [*lease["slots"], 254], time.monotonic() + 60))
            c.put(five, blocks(five))
            with pytest.raises(RemoteError, match="an earlier shared-memory put failed: 5 keys") as info:
                c.lookup(five)
            assert info.value.code == Code.BAD_REQUEST
            assert c.lookup(five).num_blocks == 0 and c.stats()["host"]["num_blocks"] == 0
            c.put(five, blocks(five))  # the next put works as ever
            assert torch.equal(c.get(five), blocks(five))
    finally:
        d.stop()


def test_close_after_a_refused_commit_still_closes(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "data", "--max-namespaces", "1", host_mem="1MiB", disk="0")
    try:
        c = d.connect(shm=True)
        keys = c.block_keys(prompt(62, 4))
        c._writes.leases.append((10**9, [250, 251, 252, 253], time.monotonic() + 60))  # unknown to the daemon
        c.put(keys, blocks(keys))
        c.close()  # reads the refusal (a warning), and closes all the same
        assert c.num_lost_puts == 4 and c._channel.sock.fileno() == -1
        with d.connect(shm=True) as other:
            assert other.lookup(keys).num_blocks == 0
    finally:
        d.stop()


def test_threads_sharing_one_client_put_and_get_through_pipelined_commits(tmp_path: Path) -> None:
    """Several threads on one shared-memory client: each put's copy runs outside the client's
    lock while other threads' commits are in flight; every get returns exactly the bytes put."""
    d = DaemonProc(tmp_path / "data", "--max-namespaces", "1", host_mem="2MiB", disk="0")
    try:
        with d.connect(shm=True) as c:
            def worker(t: int) -> None:
                for r in range(25):
                    keys = c.block_keys(prompt(1000 + 100 * t + r, 3 + (r + t) % 3))
                    c.put(keys, blocks(keys))
                    assert torch.equal(c.get(keys), blocks(keys))  # ordered after the put
                    if r % 4 == 0:
                        c.delete(keys)

            run_in_threads(worker, 4)
            assert c.num_lost_puts == 0
            c.flush()
            with d.connect(shm=False) as other:  # another client sees every block kept
                keys = c.block_keys(prompt(1000 + 100 * 3 + 23, 3 + (23 + 3) % 3))  # kept: 23 % 4 != 0
                assert torch.equal(other.get(keys), blocks(keys))
    finally:
        d.stop()


def test_large_puts_are_copied_in_by_shared_threads_and_read_back_whole(tmp_path: Path) -> None:
    """Puts of 5 MiB, in a row (each commit read by the next put): the client copies them into
    the pool on its copier's threads; another client reads every byte back over the socket."""
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)  # 32 KiB
    d = DaemonProc(tmp_path / "data", "--max-namespaces", "1", host_mem="48MiB", disk="0")
    try:
        with d.connect(shm=True, layout=layout) as c, d.connect(shm=False, layout=layout) as other:
            chains = [c.block_keys(prompt(40 + r, 160, layout.block_size)) for r in range(3)]
            for keys in chains:
                c.put(keys, blocks(keys, layout))
            if torch.get_num_threads() > 1:  # the shared path ran (5 MiB >= MIN_BYTES): its helper is up
                assert any(t.name.startswith("kvstore-copy") for t in threading.enumerate())
            c.flush()
            for keys in chains:
                assert torch.equal(other.get(keys), blocks(keys, layout))
    finally:
        d.stop()
