"""DiskTier on real files and a real LMDB: roundtrips, coalesced reads, allocation, reopen."""

from __future__ import annotations

import errno
import hashlib
import itertools
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

import kvstore.tiers.slab as slab_module
from kvstore.tiers.checksums import checksum
from kvstore.tiers.disk import DiskEntry, DiskTier
from kvstore.tiers.errors import TierFullError
from kvstore.tiers.records import Record, decode_record, encode_record

from factories import require

PAYLOAD = 6000  # not a multiple of 4096: slots are 8192 bytes with 2192 bytes of padding
SLOT = 8192


def make_key(i: int, salt: bytes = b"") -> bytes:
    return hashlib.sha256(salt + i.to_bytes(8, "little")).digest()


def payload_for(key: bytes, size: int = PAYLOAD, version: str = "v0") -> torch.Tensor:
    """Deterministic bytes per (key, version), so any reader knows what a key must hold."""
    return torch.frombuffer(
        bytearray(hashlib.shake_128(key + version.encode()).digest(size)), dtype=torch.uint8
    )


def aligned_rows(n: int, row_bytes: int) -> tuple[mmap.mmap, list[torch.Tensor]]:
    """Page-aligned rows (like the host pool's slots): the O_DIRECT zero-copy read path."""
    memory = mmap.mmap(-1, n * row_bytes)
    pool = torch.frombuffer(memory, dtype=torch.uint8).view(n, row_bytes)
    return memory, list(pool)


def unaligned_outs(n: int, size: int = PAYLOAD) -> list[torch.Tensor]:
    """Outs that start 64 bytes past a page boundary: the bounce-buffer read path."""
    return [torch.zeros(size + 4096 + 64, dtype=torch.uint8)[64 : 64 + size] for _ in range(n)]


def put(tier: DiskTier, keys: list[bytes], version: str = "v0", tenant: str = "t") -> list[int]:
    slots = tier.allocate(len(keys))
    payloads = [payload_for(k, tier.payload_bytes, version) for k in keys]
    tier.write(keys, slots, payloads, [tenant] * len(keys), "layout-a")
    return slots


def assert_reads_back(tier: DiskTier, keys: list[bytes], slots: list[int], version: str = "v0") -> None:
    outs = unaligned_outs(len(keys), tier.payload_bytes)
    assert tier.read(keys, slots, outs) == [True] * len(keys)
    for key, out in zip(keys, outs, strict=True):
        assert torch.equal(out, payload_for(key, tier.payload_bytes, version)), f"wrong bytes for {key.hex()}"


def test_geometry_and_preallocation(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 10 * SLOT + 100, PAYLOAD)
    assert (tier.payload_bytes, tier.slot_bytes, tier.num_slots) == (PAYLOAD, SLOT, 10)
    assert tier.capacity_bytes == 10 * SLOT
    assert (tier.num_free, tier.num_used, tier.num_reserved) == (10, 0, 0)
    slab = tmp_path / "d" / "slab-000.bin"
    assert slab.stat().st_size == 10 * SLOT
    assert slab.stat().st_blocks * 512 >= 10 * SLOT, "slab is not preallocated"
    assert isinstance(tier.direct_io, bool)
    tier.close()


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("payload_bytes", [PAYLOAD, SLOT])
def test_roundtrip_aligned_and_bounced(tmp_path: Path, direct_io: bool, payload_bytes: int) -> None:
    tier = DiskTier(tmp_path / "d", 16 * SLOT, payload_bytes, direct_io=direct_io)
    if not direct_io:
        assert tier.direct_io is False
    keys = [make_key(i) for i in range(6)]
    memory, sources = aligned_rows(6, SLOT)  # aligned, slot-long payloads: zero-copy writes
    for key, row in zip(keys[:3], sources[:3], strict=True):
        row[:payload_bytes] = payload_for(key, payload_bytes)
    slots = tier.allocate(6)
    payloads = sources[:3] + [payload_for(k, payload_bytes) for k in keys[3:]]
    tier.write(keys, slots, payloads, ["t"] * 6, "layout-a")
    _, rows = aligned_rows(6, SLOT)
    assert tier.read(keys, slots, rows) == [True] * 6
    for key, row in zip(keys, rows, strict=True):
        assert torch.equal(row[:payload_bytes], payload_for(key, payload_bytes))
    assert_reads_back(tier, keys, slots)
    assert tier.bytes_written == 6 * payload_bytes
    assert tier.bytes_read == 12 * payload_bytes
    assert tier.errors == 0
    tier.check_integrity()
    tier.close()
    memory.close()


def test_memoryview_payloads_and_padding_is_zero(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 4 * SLOT, PAYLOAD)
    key = make_key(1)
    data = bytes(payload_for(key).numpy()) + b"\xff" * 100  # longer than payload_bytes
    slot = tier.allocate(1)
    tier.write([key], slot, [memoryview(data)], ["t"], "layout-a")
    tier.close()
    raw = (tmp_path / "d" / "slab-000.bin").read_bytes()[slot[0] * SLOT : (slot[0] + 1) * SLOT]
    assert raw[:PAYLOAD] == data[:PAYLOAD]
    assert raw[PAYLOAD:] == bytes(SLOT - PAYLOAD), "slot padding must be zeros"


def count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(os, name)

    def counting(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(slab_module.os, name, counting)
    return calls


def test_contiguous_slots_read_with_one_preadv_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = DiskTier(tmp_path / "d", 32 * SLOT, PAYLOAD)
    keys = [make_key(i) for i in range(8)]
    writes = count_calls(monkeypatch, "pwritev")
    slots = put(tier, keys)
    assert slots == list(range(8))
    assert len(writes) == 1, "one contiguous run is one pwritev"
    reads = count_calls(monkeypatch, "preadv")
    assert_reads_back(tier, keys, slots)
    assert reads == [0]
    reads.clear()
    pick = [7, 0, 6, 1, 3, 2]  # runs {0,1,2,3} and {6,7}, in any order
    outs = unaligned_outs(len(pick))
    assert tier.read([keys[i] for i in pick], [slots[i] for i in pick], outs) == [True] * len(pick)
    for i, out in zip(pick, outs, strict=True):
        assert torch.equal(out, payload_for(keys[i]))
    assert sorted(reads) == [0, 6 * SLOT]
    tier.close()


def test_reopen_finds_everything_and_frees_the_rest(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 16 * SLOT, PAYLOAD)
    keys = [make_key(i) for i in range(5)]
    slots = put(tier, keys, tenant="alice")
    reserved = tier.allocate(3)  # reserved, never written: free after reopen
    assert tier.num_reserved == 3
    before = sorted(tier.entries(), key=lambda e: e.slot)
    tier.close()
    tier.close()  # idempotent

    tier = DiskTier(tmp_path / "d", 16 * SLOT, PAYLOAD)
    after = sorted(tier.entries(), key=lambda e: e.slot)
    assert after == before
    assert [(e.key, e.slot, e.tenant, e.layout_id) for e in after] == [
        (k, s, "alice", "layout-a") for k, s in zip(keys, slots, strict=True)
    ]
    assert all(isinstance(e, DiskEntry) and e.created <= e.last_access for e in after)
    assert (tier.num_used, tier.num_free, tier.num_reserved) == (5, 11, 0)
    assert set(tier.allocate(11)) == set(range(16)) - set(slots)
    assert set(reserved) <= set(range(5, 16))
    assert_reads_back(tier, keys, slots)
    tier.check_integrity()
    tier.close()


def test_allocation_is_contiguous_best_fit(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 20 * SLOT, PAYLOAD)
    assert tier.allocate(3) == [0, 1, 2]
    assert tier.allocate(4) == [3, 4, 5, 6]
    assert tier.allocate(0) == []
    tier.release([0, 1, 2])
    assert tier.allocate(2) == [0, 1], "best fit takes the 3-slot hole, not the 13-slot tail"
    assert tier.allocate(5) == [7, 8, 9, 10, 11]
    tier.release([3, 5])
    assert tier.allocate(1) in ([2], [3], [5])
    with pytest.raises(TierFullError, match=r"need 99 disk slots, 10 free of 20"):
        tier.allocate(99)
    tier.check_integrity()
    tier.close()


def test_fragmented_allocation_takes_largest_extents_first(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 12 * SLOT, PAYLOAD)
    tier.allocate(12)
    tier.release([1, 2, 5, 8, 9, 10])  # free extents: [1,2] [5] [8,9,10]
    got = tier.allocate(5)
    assert got[:3] == [8, 9, 10] and sorted(got[3:]) in ([1, 2],), got
    assert tier.num_free == 1
    tier.check_integrity()
    tier.close()


def test_release_checks_state(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    slots = put(tier, [make_key(0)])
    with pytest.raises(ValueError, match="used, not reserved"):
        tier.release(slots)
    with pytest.raises(ValueError, match="free, not reserved"):
        tier.release([5])
    with pytest.raises(ValueError, match="out of range"):
        tier.release([8])
    tier.close()


def test_delete_and_overwrite_free_slots(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    keys = [make_key(i) for i in range(4)]
    slots = put(tier, keys)
    tier.delete([keys[1], make_key(99)])  # unknown keys are ignored
    assert tier.num_used == 3 and tier.num_free == 5
    assert {e.key for e in tier.entries()} == {keys[0], keys[2], keys[3]}
    new_slots = put(tier, [keys[0]], version="v1")  # overwrite: the old slot is freed on commit
    assert new_slots != slots[:1]
    assert tier.num_used == 3
    assert [e.slot for e in tier.entries() if e.key == keys[0]] == new_slots
    assert_reads_back(tier, [keys[0]], new_slots, version="v1")
    tier.check_integrity()
    tier.close()
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    assert {e.key: e.slot for e in tier.entries()} == {
        keys[0]: new_slots[0],
        keys[2]: slots[2],
        keys[3]: slots[3],
    }
    tier.close()


def test_touch_is_lazy_and_persists(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    keys = [make_key(i) for i in range(3)]
    put(tier, keys)
    stamp0 = {e.key: e.last_access for e in tier.entries()}
    tier.touch([keys[0], make_key(42)])
    shown = {e.key: e.last_access for e in tier.entries()}
    assert shown[keys[0]] > stamp0[keys[0]] and shown[keys[1]] == stamp0[keys[1]]
    tier.flush()
    tier.touch([keys[1]])
    put(tier, [make_key(7)])  # pending stamps commit with the write
    tier.close()
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    stored = {e.key: e.last_access for e in tier.entries()}
    assert stored[keys[0]] == shown[keys[0]]
    assert stored[keys[1]] > stamp0[keys[1]]
    assert stored[keys[2]] == stamp0[keys[2]]
    tier.close()


def test_falls_back_to_buffered_when_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def refuse_direct(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported here")
        return real_open(path, flags, *args)

    monkeypatch.setattr(slab_module.os, "open", refuse_direct)
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    monkeypatch.undo()
    assert tier.direct_io is False
    keys = [make_key(i) for i in range(3)]
    slots = put(tier, keys)
    _, rows = aligned_rows(3, SLOT)
    assert tier.read(keys, slots, rows) == [True] * 3
    assert_reads_back(tier, keys, slots)
    assert tier.stats()["direct_io"] is False
    tier.close()


def test_concurrent_reads_with_writes_and_deletes(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 64 * SLOT, PAYLOAD, sync=False)
    stable = [make_key(i) for i in range(16)]
    stable_slots = put(tier, stable)
    failures: list[str] = []

    def reader() -> None:
        for _ in range(30):
            outs = unaligned_outs(16)
            if tier.read(stable, stable_slots, outs) != [True] * 16:
                failures.append("read failed")
            elif not all(torch.equal(o, payload_for(k)) for k, o in zip(stable, outs, strict=True)):
                failures.append("wrong bytes")

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for thread in threads:
        thread.start()
    for round_ in range(30):
        churn = [make_key(i, salt=b"churn%d" % round_) for i in range(8)]
        put(tier, churn)
        tier.delete(churn[::2])
        tier.delete(churn[1::2])
    for thread in threads:
        thread.join()
    assert failures == []
    tier.check_integrity()
    assert tier.num_used == 16
    tier.close()


def test_stats(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 8 * SLOT, PAYLOAD)
    keys = [make_key(i) for i in range(2)]
    slots = put(tier, keys)
    assert_reads_back(tier, keys, slots)
    stats = tier.stats()
    assert stats["num_used"] == 2 and stats["num_free"] == 6 and stats["num_slots"] == 8
    assert stats["bytes_written"] == stats["bytes_read"] == 2 * PAYLOAD
    assert stats["errors"] == 0
    tier.close()


def test_format_matches_docs_storage_format() -> None:
    """The checksum test vector and the example record in docs/storage-format.md."""
    key = bytes(range(32))
    payload = bytes(i % 251 for i in range(4096))
    digest = checksum(key, payload)
    assert digest.hex() == "c8cc37ce451547ce8c0b9e5900e9663a"
    record = Record(7, digest, "llama-3-8b/bf16", "tenant-a", 1700000000.0, 1700000100.5)
    value = encode_record(record)
    assert value.hex() == (
        "01" + "0700000000000000" + "c8cc37ce451547ce8c0b9e5900e9663a" + "00000040fc54d941"
        "00002059fc54d941" + "0f00" + "0800" + b"llama-3-8b/bf16".hex() + b"tenant-a".hex()
    )
    assert decode_record(value) == record


def test_short_transfers_resume_inside_an_iovec() -> None:
    disk = bytearray(range(256)) * 100
    moved: list[int] = []

    def stingy_read(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        budget = 777  # fewer bytes than asked, ending mid-iovec
        done = 0
        for buf in buffers:
            take = min(len(buf), budget - done)
            buf[:take] = disk[offset + done : offset + done + take]
            done += take
            if done == budget:
                break
        moved.append(done)
        return done

    outs = [bytearray(1000), bytearray(3000), bytearray(500)]
    slab_module._transfer(stingy_read, -1, [memoryview(o) for o in outs], 100)
    assert bytes(outs[0] + outs[1] + outs[2]) == bytes(disk[100:4600])
    assert sum(moved) == 4500 and len(moved) == 6


# --------------------------------------------------------------------- parallel bounced reads


def pipelined_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, num_slots: int = 64) -> DiskTier:
    """A direct-I/O tier whose bounce buffers hold 3 slots, so a read of a few blocks into
    unaligned memory is a pipeline of several chunks."""
    monkeypatch.setattr(slab_module, "BOUNCE_BYTES", 3 * SLOT)
    tier = DiskTier(tmp_path / "d", num_slots * SLOT, PAYLOAD)
    require(tier.direct_io, f"O_DIRECT on {tmp_path} (the pipeline serves direct-I/O reads only)")
    return tier


def test_a_read_of_several_transfers_keeps_two_in_flight_each_reader_with_its_own_bounce_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = pipelined_tier(tmp_path, monkeypatch)
    keys = [make_key(i) for i in range(20)]
    slots = put(tier, keys)
    assert slots == list(range(20))
    reads: list[tuple[str, int, list[int]]] = []  # (thread, first slot, addresses of its bounced iovecs)
    another_read = threading.Event()
    overlapped: list[bool] = []
    real_preadv = slab_module.os.preadv
    aligned_at = -1

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        addresses = [slab_module.address_of(b) for b in buffers if slab_module.address_of(b) != aligned_at]
        reads.append((threading.current_thread().name, offset // SLOT, addresses))
        done = real_preadv(fd, buffers, offset)
        if offset // SLOT == 0:  # the first transfer waits until another reader has read one
            overlapped.append(another_read.wait(10))
        else:
            another_read.set()
        return done

    monkeypatch.setattr(slab_module.os, "preadv", preadv)
    # two runs (slots 0-10 and 12-19), one block aligned (read in place), the rest bounced
    pick = list(range(11)) + list(range(12, 20))
    memory, rows = aligned_rows(1, SLOT)
    outs = unaligned_outs(len(pick))
    outs[4] = rows[0]
    aligned_at = rows[0].data_ptr()
    assert tier.read([keys[i] for i in pick], [slots[i] for i in pick], outs) == [True] * len(pick)
    for i, out in zip(pick, outs, strict=True):
        assert torch.equal(out[:PAYLOAD], payload_for(keys[i])), f"block {i} came back with other bytes"
    assert sorted(first for _, first, _ in reads) == [0, 3, 6, 9, 12, 15, 18], \
        "runs cut into transfers of equal size, at most 3 slots, each read once"
    assert overlapped == [True], "a second transfer was read while the first was still in hand"
    threads = {thread for thread, _, _ in reads}
    assert threading.current_thread().name in threads and any(t.startswith("disk-tier-read") for t in threads)
    # each reader bounces through a buffer of its own: no segment one reader used, the other did
    segments = {thread: {a for t, _, addresses in reads if t == thread for a in addresses} for thread in threads}
    for one, other in itertools.combinations(threads, 2):
        assert segments[one].isdisjoint(segments[other]), f"{one} and {other} shared bounce memory"
    assert tier.errors == 0
    tier.close()
    memory.close()


def test_pipelined_read_finds_a_corrupt_and_an_unreadable_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = pipelined_tier(tmp_path, monkeypatch)
    keys = [make_key(i) for i in range(12)]
    slots = put(tier, keys)
    with open(tmp_path / "d" / "slab-000.bin", "r+b") as f:  # a flipped byte in the third chunk
        f.seek(slots[7] * SLOT + 100)
        byte = f.read(1)
        f.seek(slots[7] * SLOT + 100)
        f.write(bytes([byte[0] ^ 0x5A]))
    real = slab_module.os.preadv
    bad_offset = slots[4] * SLOT  # a media error in the second chunk

    def failing(fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset <= bad_offset < offset + sum(len(b) for b in buffers):
            raise OSError(errno.EIO, "injected media error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(slab_module.os, "preadv", failing)
    outs = unaligned_outs(len(keys))
    expected = [i not in (4, 7) for i in range(12)]
    assert tier.read(keys, slots, outs) == expected
    for i, (key, out) in enumerate(zip(keys, outs, strict=True)):
        if expected[i]:
            assert torch.equal(out, payload_for(key))
    assert tier.errors == 2
    assert {keys[4], keys[7]}.isdisjoint(e.key for e in tier.entries())
    tier.check_integrity()
    tier.close()


def test_on_ready_hands_each_transfer_over_once_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 12 blocks, 3 a transfer, one corrupt, one with no block behind it: on_ready sees every
    # block with a catalog entry exactly once, with the bytes already in its out and checked
    tier = pipelined_tier(tmp_path, monkeypatch)
    keys = [make_key(i) for i in range(12)]
    slots = put(tier, keys)
    tier.delete([keys[10]])
    with open(tmp_path / "d" / "slab-000.bin", "r+b") as f:  # block 5: a flipped byte
        f.seek(slots[5] * SLOT + 100)
        byte = f.read(1)
        f.seek(slots[5] * SLOT + 100)
        f.write(bytes([byte[0] ^ 0x5A]))
    outs = unaligned_outs(len(keys))
    seen: dict[int, bool] = {}

    def on_ready(blocks: list[int], ok: list[bool]) -> None:
        for i, good in zip(blocks, ok, strict=True):
            assert i not in seen, f"block {i} handed over twice"
            seen[i] = good
            if good:  # in its out already, and verified
                assert torch.equal(outs[i][:PAYLOAD], payload_for(keys[i]))

    result = tier.read(keys, slots, outs, on_ready=on_ready)
    assert result == [i not in (5, 10) for i in range(12)]
    assert seen == {i: i != 5 for i in range(12) if i != 10}
    tier.close()


def test_a_failing_chunk_callback_leaves_no_copy_running_and_the_buffers_pooled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slab_module, "BOUNCE_BYTES", 3 * SLOT)
    slab = slab_module.Slab(str(tmp_path / "slab.bin"), 32, SLOT, PAYLOAD, direct_io=True)
    require(slab.direct_io, f"O_DIRECT on {tmp_path}")
    outs = unaligned_outs(12)
    dests = [memoryview(o.numpy()) for o in outs]
    seen: list[list[int]] = []

    def on_chunk(blocks: list[int], ok: list[bool]) -> None:
        seen.append(blocks)
        if len(seen) == 2:
            raise RuntimeError("the caller's check failed")

    with pytest.raises(RuntimeError, match="check failed"):
        slab.read(list(range(12)), dests, [False] * 12, on_chunk)
    assert len(seen) >= 2 and all(blocks in ([0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]) for blocks in seen)
    assert len(slab._bounce_pool) == slab_module.READERS, "every reader's bounce buffer went back to the pool"
    # the slab still serves, and closes cleanly (no reader holds a bounce buffer)
    assert slab.read(list(range(12)), dests, [False] * 12) == [True] * 12
    slab.close()


def test_concurrent_pipelined_reads_each_get_their_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = pipelined_tier(tmp_path, monkeypatch)
    keys = [make_key(i) for i in range(30)]
    slots = put(tier, keys)
    failures: list[str] = []

    def reader(k: int) -> None:
        pick = keys[k::3] + keys[: k + 5]
        where = [slots[keys.index(key)] for key in pick]
        for _ in range(20):
            outs = unaligned_outs(len(pick))
            if tier.read(pick, where, outs) != [True] * len(pick):
                failures.append("read failed")
            elif not all(torch.equal(o, payload_for(key)) for key, o in zip(pick, outs, strict=True)):
                failures.append("wrong bytes")

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    tier.close()
