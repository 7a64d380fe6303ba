"""Hints and kept values never serve wrong KV, and GET replies are read straight off the socket.

A hint only says whether to ask: a block deleted or overwritten on the cluster after a store
learned of it is a miss or the new bytes at that store's next read, never the old ones. The
reply reader is driven over a real socket pair, byte by byte where it matters.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from redis.exceptions import AskError, MovedError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from kvstore.store import TieredStore
from kvstore.tiers.remote import RemoteTier
from kvstore.tiers.remote.hints import Hints, KeptValues
from kvstore.tiers.remote.replies import GetReplies, Odd, ProtocolError
from kvstore.tools.bench.redis_local import RedisCluster, cli

from factories import blocks_for, chain, make_store


def remote(cluster: RedisCluster) -> TieredStore:
    return make_store(None, host_blocks=16, remote_url=cluster.url, remote_timeout_s=3.0, promotion="never")


def tier_of(store: TieredStore) -> RemoteTier:
    return store.level("remote").tier  # type: ignore[union-attr]


def owner_port(tier: RemoteTier, key: bytes) -> int:
    node = tier.owner(tier.names([key])[0])
    assert node is not None
    return node[1]


def test_a_block_deleted_on_the_cluster_is_a_miss_despite_a_fresh_hint(cluster: RedisCluster) -> None:
    with remote(cluster) as writer, remote(cluster) as reader:
        keys = chain(writer, 6, salt=21)
        writer.put(keys, blocks_for(keys))
        assert writer.flush(10)
        into = torch.zeros((6, *reader.layout.block_shape))
        assert reader.fetch(keys, into=into).result(timeout=10).num_blocks == 6  # hints: all held
        name = tier_of(reader).names(keys[2:3])[0]
        assert cli(owner_port(tier_of(reader), keys[2]), "DEL", name.decode()).strip() == "1"
        trips = reader.stats()["remote"]["round_trips"]
        assert reader.lookup(keys).tiers == ("remote",) * 6  # the hint answers, stale: a lookup is a hint
        assert reader.stats()["remote"]["round_trips"] == trips
        into.zero_()
        got = reader.fetch(keys, into=into).result(timeout=10)
        assert got.num_blocks == 2 and torch.equal(into[:2], blocks_for(keys[:2]))
        assert not into[2:].any()  # the GET decided: a miss, and nothing past it delivered
        assert reader.lookup(keys).num_blocks == 2  # the miss is a hint now


def test_a_block_overwritten_on_the_cluster_reads_as_the_new_bytes(cluster: RedisCluster) -> None:
    with remote(cluster) as writer, remote(cluster) as reader:
        keys = chain(writer, 4, salt=22)
        old = blocks_for(keys)
        writer.put(keys, old)
        assert writer.flush(10)
        assert torch.equal(reader.get(keys), old)  # hints: all held
        new = old.clone()
        new[1] += 1.0
        other = tier_of(writer)
        other.delete(keys[1:2])
        assert other.put(keys[1:2], [new[1].view(torch.uint8).reshape(-1)]) == 1  # a framed, valid value
        assert reader.lookup(keys).num_blocks == 4  # answered by the hints
        assert torch.equal(reader.get(keys), new)  # never the old bytes


def test_kept_values_are_checked_again_and_dropped_by_a_delete(cluster: RedisCluster) -> None:
    with remote(cluster) as writer, remote(cluster) as reader:
        keys = chain(writer, 4, salt=23)
        writer.put(keys, blocks_for(keys))
        assert writer.flush(10)
        tier = tier_of(reader)
        assert reader.lookup(keys).num_blocks == 4 and len(tier.kept) == 4
        taken = tier.kept.take(keys[:1])[0]  # the kept value is altered in memory: the checksum fails
        flipped = bytearray(taken)
        flipped[-1] ^= 0xFF
        tier.kept.keep(keys[:1], [memoryview(flipped)])
        into = torch.zeros((4, *reader.layout.block_shape))
        assert reader.fetch(keys, into=into).result(timeout=10).num_blocks == 0
        assert not into.any() and tier.stats()["corrupt_checksum"] == 1
        assert reader.lookup(keys).num_blocks == 0  # the value was deleted (it failed its check)
        assert reader.lookup(keys[1:]).num_blocks == 3  # the other three, answered by hints
        tier.hints.clear()
        assert reader.lookup(keys[1:]).num_blocks == 3 and len(tier.kept) == 3  # asked again: GET, kept
        reader.delete(keys[1:])  # this store's own delete: kept values and hints go with it
        assert len(tier.kept) == 0 and reader.lookup(keys[1:]).num_blocks == 0


# ------------------------------------------------------------------------- hints, kept values


def test_hints_answer_only_while_fresh_and_stay_bounded() -> None:
    hints = Hints(ttl_s=0.2, max_entries=3)
    hints.note([b"a", b"b"], [True, False])
    assert hints.known([b"a", b"b", b"c"]) == [True, False, None]
    hints.note([b"c", b"d"], True)  # four notes, room for three: the oldest goes
    assert len(hints) == 3 and hints.known([b"a", b"d"]) == [None, True]
    time.sleep(0.25)  # past the TTL under test
    assert hints.known([b"b", b"c", b"d"]) == [None, None, None]
    assert Hints(ttl_s=0).known([b"x"]) == [None]


def test_kept_values_are_taken_once_within_their_bytes_and_time() -> None:
    kept = KeptValues(ttl_s=0.2, max_bytes=10)
    kept.keep([b"a", b"b"], [b"1234", b"5678"])
    assert kept.take([b"a", b"a"]) == [b"1234", None]
    kept.keep([b"c"], [b"abcdef"])  # 4 + 6 bytes fit; one more pushes the oldest out
    kept.keep([b"d"], [b"x"])
    assert kept.num_bytes == 7 and kept.take([b"b", b"c", b"d"]) == [None, b"abcdef", b"x"]
    kept.keep([b"e"], [b"e"])
    time.sleep(0.25)  # past the TTL under test
    assert kept.take([b"e"]) == [None] and kept.num_bytes == 0


# ------------------------------------------------------------------------- the reply reader


def read_over_socket(chunks: list[bytes], n: int, value_bytes: int, pause: float = 0.0) -> list[object]:
    """The replies ``GetReplies`` reads from a real socket the other end of which sends ``chunks``."""
    ours, theirs = socket.socketpair()

    def send() -> None:
        for chunk in chunks:
            theirs.sendall(chunk)
            if pause:
                time.sleep(pause)  # a reply split across reads: the pause is the case under test
        theirs.shutdown(socket.SHUT_WR)  # then the peer is gone: a read past the stream fails

    sender = threading.Thread(target=send)
    sender.start()
    try:
        arena = bytearray(n * value_bytes)
        views = memoryview(arena)
        return GetReplies(ours).read(n, value_bytes, lambda i: views[i * value_bytes : (i + 1) * value_bytes])
    finally:
        sender.join()
        ours.close()
        theirs.close()


def test_the_reader_takes_each_kind_of_get_reply() -> None:
    value = bytes(range(200)) * 3  # 600 bytes, more than one header read
    stream = (b"$600\r\n" + value + b"\r\n" + b"$-1\r\n" + b"_\r\n" + b"$3\r\nabc\r\n"
              + b"-MOVED 42 127.0.0.1:7001\r\n" + b"-ASK 7 127.0.0.1:7002\r\n" + b"!9\r\nERR oops!\r\n"
              + b"$600\r\n" + value[::-1] + b"\r\n")
    for chunks, pause in (([stream], 0.0), ([stream[i : i + 1] for i in range(len(stream))], 0.0),
                          ([stream[:7], stream[7:300], stream[300:]], 0.01)):
        got = read_over_socket(chunks, 8, 600, pause)
        assert bytes(got[0]) == value and bytes(got[7]) == value[::-1]  # type: ignore[arg-type]
        assert got[1] is None and got[2] is None
        assert isinstance(got[3], Odd) and got[3].length == 3 and bytes(got[3].value) == b"abc"  # type: ignore[arg-type]
        assert isinstance(got[4], MovedError) and got[4].slot_id == 42 and got[4].port == 7001
        assert isinstance(got[5], AskError) and not isinstance(got[5], MovedError) and got[5].port == 7002
        assert isinstance(got[6], ResponseError) and "oops" in str(got[6])


def test_the_reader_refuses_a_stream_out_of_step() -> None:
    with pytest.raises(ProtocolError):
        read_over_socket([b":1\r\n"], 1, 8)  # an integer: no GET replies with one
    with pytest.raises(ProtocolError):
        read_over_socket([b"$4\r\nabcdXY"], 1, 4)  # the value's CRLF is not there
    with pytest.raises(ProtocolError):
        read_over_socket([b"$-1\r\n$-1\r\n"], 1, 4)  # more than the replies asked for
    with pytest.raises(RedisConnectionError):
        read_over_socket([b"$8\r\nabc"], 1, 8)  # the peer closes halfway through a value
