"""The daemon's lease table (kvstore/services/daemon/shm.py): one connection's limit on the leases it
holds, against a real store, and through a real daemon process."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from kvstore.protocol import Code, ProtocolError, RemoteError
from kvstore.services.daemon.registry import NamespaceState
from kvstore.services.daemon.shm import Leases, leases_per_connection

from daemon_helpers import DaemonProc, blocks, prompt
from factories import make_store
from waiting import wait_until


def test_requests_of_one_connection_on_several_threads_cannot_pass_its_lease_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight grants of one connection run at once (as its requests do on the daemon's
    workers), each held inside the store until all have been counted: four are granted and
    four refused with LEASE, never more than the limit. A check made before the grant and
    counted only after it let all eight through."""
    store = make_store(tmp_path, host_blocks=16, shared_host=True)
    state = NamespaceState("ns", "model", store.layout, "sha256", store)
    leases = Leases(lease_s=10.0, max_per_conn=4)
    inside = threading.Semaphore(0)
    go = threading.Event()
    real_reserve = store.host_leases.reserve

    def held_reserve(n: int, **kw: object) -> list[int] | None:
        inside.release()
        assert go.wait(10)
        return real_reserve(n, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(store.host_leases, "reserve", held_reserve)
    granted: list[int] = []
    refused: list[ProtocolError] = []

    def grant() -> None:
        try:
            granted.append(leases.grant_write(1, state, [b""], "").id)
        except ProtocolError as exc:
            refused.append(exc)

    threads = [threading.Thread(target=grant) for _ in range(8)]
    for t in threads:
        t.start()
    entered = 0

    def all_counted() -> bool:
        nonlocal entered
        entered += inside.acquire(timeout=0.05)
        return entered + len(refused) == 8

    wait_until(all_counted, 10, lambda: f"8 grants held or refused ({entered} held, {len(refused)} refused)")
    go.set()
    for t in threads:
        t.join(10)
    assert (len(granted), len(refused)) == (4, 4), (granted, refused)
    assert all(exc.code == Code.LEASE and "the limit is 4" in exc.message for exc in refused)
    assert len(leases) == 4
    # a lease taken (to commit or release it) frees a place; an expired one does too
    lease = leases.take(1, granted[0], "write")
    assert lease is not None
    store.host_leases.cancel(lease.slots)
    leases.grant_write(1, state, [b""], "")  # the place it freed
    with pytest.raises(ProtocolError, match="holds 4 leases"):
        leases.grant_write(1, state, [b""], "")
    assert leases.grant_write(2, state, [b""], "").conn == 2  # another connection has its own limit
    assert leases.expire(now=time.monotonic() + 11) == 5
    leases.grant_write(1, state, [b""], "")
    # a grant the store refuses counts nothing
    monkeypatch.setattr(store.host_leases, "reserve", lambda n, **kw: None)
    for _ in range(5):
        assert leases.grant_write(1, state, [b""], "", evict=False, blocking=False) is None
    monkeypatch.setattr(store.host_leases, "reserve", real_reserve)
    for _ in range(3):
        leases.grant_write(1, state, [b""], "")
    with pytest.raises(ProtocolError, match="holds 4 leases"):
        leases.grant_write(1, state, [b""], "")
    leases.drop_connection(1)
    leases.drop_connection(2)
    leases.expire(now=time.monotonic() + 100)  # the quarantined slots go back too
    assert len(leases) == 0
    store.check_integrity()
    assert store.stats()["host"]["used_bytes"] == 0
    store.close()


def test_a_client_hoarding_leases_is_refused_and_what_it_held_goes_back_when_it_closes(tmp_path: Path) -> None:
    """A client that takes write leases and never commits them gets LEASE at 2 x max_inflight
    + 3, for read leases as well; other connections are served as ever, a commit frees a
    place, and the slots it still held are free again once it disconnects. A client that
    keeps to the protocol never meets the limit, even at max_inflight = 1 (its standing write
    leases alone filled a limit of 2 x max_inflight, and its next get's lease was refused)."""
    config = tmp_path / "kvstore.toml"
    config.write_text("max_inflight = 1\n")  # a limit of 5 leases per connection
    limit = leases_per_connection(1)
    d = DaemonProc(tmp_path / "data", "--config", str(config), "--max-namespaces", "1", host_mem="1MiB", disk="0")
    try:
        hoarder = d.connect(shm=True)
        with d.connect(shm=True) as other:
            puts = [other.block_keys(prompt(80 + i, 3)) for i in range(6)]
            for keys in puts:
                other.put(keys, blocks(keys))
            for keys in puts:
                assert torch.equal(other.get(keys), blocks(keys))
            chains = [hoarder.block_keys(prompt(70 + i, 2)) for i in range(limit + 2)]
            leases = [hoarder._call({"op": "reserve", "keys": hoarder._keys_blob(keys)})[0] for keys in chains[:limit]]
            with pytest.raises(RemoteError, match=f"connection holds {limit} leases, the limit is {limit}") as info:
                hoarder._call({"op": "reserve", "keys": hoarder._keys_blob(chains[limit])})
            assert info.value.code == Code.LEASE
            with pytest.raises(RemoteError, match=f"holds {limit} leases") as info:  # a read lease counts too
                hoarder._call({"op": "get", "keys": hoarder._keys_blob(puts[0]), "shm": True})
            assert info.value.code == Code.LEASE
            keys = other.block_keys(prompt(90, 3))  # the other connection is served as ever
            other.put(keys, blocks(keys))
            assert torch.equal(other.get(keys), blocks(keys))
            hoarder._call({"op": "commit", "lease": leases[0]["lease"]})  # publishes chains[0] (unwritten: zeros)
            hoarder._call({"op": "reserve", "keys": hoarder._keys_blob(chains[limit])})  # the place it freed
            assert hoarder._mapped is not None
            held = limit * 2 * hoarder._mapped.slot_bytes  # its leases of two slots each
            before = other.stats()["host"]["used_bytes"]
            hoarder.close()
            wait_until(lambda: other.stats()["host"]["used_bytes"] == before - held, 10,
                       "the closed hoarder's slots free again")
            assert other.stats()["host"]["used_bytes"] == before - held
            assert other.lookup(chains[1]).num_blocks == 0  # reserved, never committed: never published
            assert torch.equal(other.get(keys), blocks(keys))
    finally:
        d.stop()
