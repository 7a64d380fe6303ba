"""The socket's data path. Large data sections: the connection moves them itself in tight
readv/writev loops while the bytes flow, and hands them back to the transport when the peer
stalls; whatever the pace, the bytes put are the bytes got, and a put cut off mid-way
publishes nothing. A get of blocks all in host RAM is written straight from their slots,
which are held until then and released before the connection's next request runs."""

from __future__ import annotations

import itertools
import random
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_daemon_frames import reply

from kvstore import CapacityError, KVLayout, LayoutMismatchError
from kvstore.protocol import HEADER, VERSION, encode, layout_to_dict
from kvstore.services.daemon.bulk_io import BULK_MAX_S, BULK_MIN, BulkPace

from daemon_helpers import LAYOUT, DaemonProc, blocks, prompt
from factories import run_in_threads
from waiting import wait_until

# 64 KiB blocks: a 200-block reply (12.5 MiB) outgrows the daemon's socket buffer (8 MiB),
# so a reader that pauses makes the writer stall; 8 blocks (512 KiB) already take the loops.
BIG = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
HELLO = {"op": "hello", "version": VERSION, "model_id": "test-model", "layout": layout_to_dict(BIG)}
assert 8 * BIG.bytes_per_block >= BULK_MIN


@pytest.fixture(scope="module", name="big_daemon")
def big_daemon_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    proc = DaemonProc(tmp_path_factory.mktemp("bulk") / "data", "--max-namespaces", "1",
                      host_mem="48MiB", disk="0")
    yield proc
    if proc.proc.poll() is None:
        proc.kill9()


def hello(d: DaemonProc) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(d.unix[len("unix://"):])
    s.sendall(encode(HELLO))
    assert "error" not in (reply(s) or {"error": "closed"})
    return s


def payload(keys: list[bytes]) -> bytes:
    return blocks(keys, BIG).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("disk", ["0", "16MiB"])  # the commit on the event loop; on a worker (write-through)
def test_large_socket_puts_and_gets_return_the_bytes_put(tmp_path: Path, disk: str) -> None:
    d = DaemonProc(tmp_path / "data", "--max-namespaces", "1", host_mem="16MiB", disk=disk)
    try:
        with d.connect(shm=False, layout=BIG) as c:
            for salt in range(3):
                keys = c.block_keys(prompt(salt, 64, BIG.block_size))
                c.put(keys, blocks(keys, BIG))
                assert torch.equal(c.get(keys), blocks(keys, BIG))
                assert c.lookup(keys).tiers == ("host",) * 64
            stats = c.stats()
            assert stats["host"]["num_blocks"] == 192
            if disk != "0":  # write-through: each commit wrote the level below before its reply
                assert stats["disk"]["num_blocks"] == 192
    finally:
        assert d.stop() == 0


def test_a_put_whose_data_pauses_mid_way_is_received_whole(big_daemon: DaemonProc) -> None:
    s = hello(big_daemon)
    with big_daemon.connect(shm=False, layout=BIG) as c:
        keys = c.block_keys(prompt(101, 40, BIG.block_size))
        data = payload(keys)
        s.sendall(encode({"op": "put", "id": 1, "keys": b"".join(keys)}, len(data)) + data[: 300 << 10])
        cut = [300 << 10, 301 << 10, 1 << 20, 2 << 20, len(data)]
        for start, stop in itertools.pairwise(cut):
            time.sleep(0.03)  # past the tight loop's wait: the transport takes the bytes again
            s.sendall(data[start:stop])
        assert reply(s) == {"id": 1, "num_blocks": 40}
        assert torch.equal(c.get(keys), blocks(keys, BIG))
    s.close()


def test_a_large_get_to_a_reader_that_pauses_arrives_whole(big_daemon: DaemonProc) -> None:
    with big_daemon.connect(shm=False, layout=BIG) as c:
        keys = c.block_keys(prompt(202, 200, BIG.block_size))
        c.put(keys, blocks(keys, BIG))
    s = hello(big_daemon)
    s.sendall(encode({"op": "get", "id": 2, "keys": b"".join(keys)}))
    time.sleep(0.2)  # the pause under test: the daemon fills its socket buffer and stalls; then the rest
    head = s.recv(HEADER.size, socket.MSG_WAITALL)
    meta_len, data_len = HEADER.unpack(head)
    s.recv(meta_len, socket.MSG_WAITALL)
    assert data_len == 200 * BIG.bytes_per_block
    got = bytearray(data_len)
    view, n = memoryview(got), 0
    while n < data_len:
        n += s.recv_into(view[n:], min(1 << 20, data_len - n))
        time.sleep(0.002)  # a slow reader
    assert bytes(got) == payload(keys)
    s.close()


def test_a_large_put_cut_off_mid_way_publishes_nothing(big_daemon: DaemonProc) -> None:
    with big_daemon.connect(shm=False, layout=BIG) as c:
        used = c.stats()["host"]["used_bytes"]
        keys = c.block_keys(prompt(303, 60, BIG.block_size))
        data = payload(keys)
        s = hello(big_daemon)
        s.sendall(encode({"op": "put", "id": 1, "keys": b"".join(keys)}, len(data)) + data[: len(data) // 2])
        wait_until(lambda: c.stats()["host"]["used_bytes"] != used, 10, "the put's host slots reserved")
        s.close()
        # the reservation ends with the connection
        wait_until(lambda: c.stats()["host"]["used_bytes"] == used, 5, "the cut-off put's slots given back")
        assert c.stats()["host"]["used_bytes"] == used
        assert c.lookup(keys).num_blocks == 0
        c.put(keys, blocks(keys, BIG))
        assert torch.equal(c.get(keys), blocks(keys, BIG))


def test_a_large_put_of_small_blocks_lands_in_its_many_slots(tmp_path: Path) -> None:
    # 512-byte blocks in 4 KiB slots: 600 of them are 600 separate views (one readv fills many)
    d = DaemonProc(tmp_path / "data", "--max-namespaces", "1", host_mem="8MiB", disk="0")
    try:
        with d.connect(shm=False) as c:
            keys = c.block_keys(prompt(404, 600))
            assert 600 * LAYOUT.bytes_per_block >= BULK_MIN
            c.put(keys, blocks(keys))
            assert torch.equal(c.get(keys), blocks(keys))
            assert c.stats()["host"]["num_blocks"] == 600
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("shm", [False, True])
def test_with_small_frames_every_call_is_split_to_fit(tmp_path: Path, shm: bool) -> None:
    """With an 8 KiB max_frame, hello tells the client how many keys (224) and blocks (13) a
    request carries, and every call of any size is split to fit: before, a lookup, exists,
    pin, unpin or delete of more keys than fit one frame was refused with TOO_LARGE, which
    also closed the connection. A layout whose one block cannot fit is refused at hello with
    a clear error, taking no namespace slot."""
    config = tmp_path / "kvstore.toml"
    config.write_text("max_frame = 8192\n")
    d = DaemonProc(tmp_path / "data", "--config", str(config), "--max-namespaces", "1", host_mem="8MiB", disk="0")
    try:
        too_big = KVLayout(num_layers=2, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32)
        with pytest.raises(LayoutMismatchError, match="16384 bytes: with its key it does not fit this daemon's max_frame of 8192"):
            d.connect(layout=too_big)
        with d.connect(shm=shm) as c:
            assert (c.max_keys, c.max_blocks) == ((8192 - 1024) // 32, (8192 - 1024) // (LAYOUT.bytes_per_block + 32))
            keys = c.block_keys(prompt(500, 600))
            c.put(keys, blocks(keys))
            assert c.lookup(keys).num_blocks == 600 and c.contains(keys) == [True] * 600
            assert torch.equal(c.get(keys), blocks(keys))
            c.pin(keys)
            with pytest.raises(CapacityError):
                c.delete(keys[:10])  # pinned: refused, the connection still serves
            c.unpin(keys)
            assert c.delete(keys) == 600
            assert c.contains(keys) == [False] * 600 and c.stats()["host"]["num_blocks"] == 0
    finally:
        assert d.stop() == 0


def test_the_tight_loops_wait_only_on_a_peer_that_keeps_pace() -> None:
    pace = BulkPace()
    assert pace.keeps_up()  # the grace: a fresh loop waits for its first bytes
    pace.start -= 0.01  # 10 ms in: 1 MB was due at 100 MB/s
    assert not pace.keeps_up()
    pace.moved = 2 << 20
    assert pace.keeps_up()
    pace.start -= BULK_MAX_S  # however fast, never past BULK_MAX_S
    pace.moved = 1 << 40
    assert not pace.keeps_up()


def test_a_trickled_put_is_received_whole_while_others_are_served(big_daemon: DaemonProc) -> None:
    s = hello(big_daemon)
    with big_daemon.connect(shm=False, layout=BIG) as c:
        keys = c.block_keys(prompt(505, 8, BIG.block_size))
        data = payload(keys)
        s.sendall(encode({"op": "put", "id": 3, "keys": b"".join(keys)}, len(data)))
        other = c.block_keys(prompt(506, 1, BIG.block_size))
        for i, start in enumerate(range(0, len(data), 16 << 10)):
            s.sendall(data[start : start + (16 << 10)])  # 16 KiB at a time, far below BULK_RATE
            time.sleep(0.003)  # a trickle: the slow sender under test
            if i % 8 == 0:  # the daemon keeps serving another connection meanwhile
                c.put(other, blocks(other, BIG))
                assert torch.equal(c.get(other), blocks(other, BIG))
                c.delete(other)
        assert reply(s) == {"id": 3, "num_blocks": 8}
        assert torch.equal(c.get(keys), blocks(keys, BIG))
    s.close()


def test_a_get_from_host_slots_releases_them_before_the_next_request(big_daemon: DaemonProc) -> None:
    with big_daemon.connect(shm=False, layout=BIG) as c:
        hits = c.stats()["host"]["hits"]
        for salt in range(40):  # get, then at once delete: never "being read"
            keys = c.block_keys(prompt(600 + salt, 8, BIG.block_size))
            c.put(keys, blocks(keys, BIG))
            assert torch.equal(c.get(keys), blocks(keys, BIG))
            assert c.delete(keys) == 8
        assert c.stats()["host"]["hits"] == hits + 40 * 8  # counted as the copying get was


def test_a_get_reaching_disk_names_each_blocks_tier(tmp_path: Path) -> None:
    # 2 MiB of host: 32 slots of 64 KiB; a 48-block prompt puts its head on disk
    d = DaemonProc(tmp_path / "data", "--max-namespaces", "1", host_mem="2MiB", disk="16MiB")
    try:
        with d.connect(shm=False, layout=BIG) as c:
            keys = c.block_keys(prompt(700, 48, BIG.block_size))
            c.put(keys, blocks(keys, BIG))
            into = torch.empty_like(blocks(keys, BIG))
            result = c.fetch(keys, into).result()
            assert result.num_blocks == 48 and "disk" in result.tiers
            assert torch.equal(into, blocks(keys, BIG))
            on_host = [k for k, t in zip(keys, c.lookup(keys).tiers, strict=True) if t == "host"][:8]
            assert len(on_host) == 8
            result = c.fetch(on_host, into[:8]).result()  # all in host RAM: sent from the slots
            assert result.tiers == ("host",) * 8 and torch.equal(into[:8], blocks(on_host, BIG))
    finally:
        assert d.stop() == 0


def test_concurrent_puts_gets_and_deletes_never_return_other_bytes(big_daemon: DaemonProc) -> None:
    """Socket and shared-memory clients race on the same chains (received into slots,
    committed on the loop, gets written from held slots): every get returns the bytes put
    under its keys, or a miss; a delete meeting a get in flight is refused, never wrong."""
    with big_daemon.connect(shm=False, layout=BIG) as c:
        chains = [c.block_keys(prompt(900 + s, 12, BIG.block_size)) for s in range(4)]
    expected = [blocks(keys, BIG) for keys in chains]
    counts: Counter[str] = Counter()
    wrong: list[str] = []
    stop = time.monotonic() + 3.0

    def worker(i: int) -> None:
        rnd = random.Random(i)
        with big_daemon.connect(shm=i % 2 == 0, layout=BIG) as client:
            while time.monotonic() < stop:
                s = rnd.randrange(len(chains))
                op = rnd.random()
                try:
                    if op < 0.4:
                        client.put(chains[s], expected[s])
                        counts["put"] += 1
                    elif op < 0.85:
                        n = rnd.randrange(1, 13)
                        if not torch.equal(client.get(chains[s][:n]), expected[s][:n]):
                            wrong.append(f"chain {s}, {n} blocks")
                        counts["get"] += 1
                    else:
                        client.delete(chains[s])
                        counts["delete"] += 1
                except KeyError:
                    counts["miss"] += 1
                except CapacityError:
                    counts["busy"] += 1

    run_in_threads(worker, 4)
    assert wrong == []
    assert counts["get"] > 20 and counts["put"] > 20 and counts["delete"] > 5, counts
