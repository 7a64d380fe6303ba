"""Cache management over a real daemon: the block protocol (StoreClient) and REST
(``/v1/cache/*``). Pin leases (a TTL; a client killed by kill -9), prefetch handles, inspect,
delete with descendants, forget; tenant tokens act on their own tenant only, the admin token
on any; bad input is a clear error and changes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvstore.api import MAX_KEYS
from kvstore.protocol import Code, RemoteError

from daemon_helpers import LAYOUT, ROOT, DaemonProc, blocks, prompt
from daemon_helpers import call as rest_call
from waiting import wait_until

ADMIN, ACME, GLOBEX = "tok-admin", "tok-acme", "tok-globex"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    root = tmp_path_factory.mktemp("cache")
    tokens = root / "tokens.toml"
    tokens.write_text(f'[[tenant]]\nname = "acme"\ntokens = ["{ACME}"]\n\n'
                      f'[[tenant]]\nname = "globex"\ntokens = ["{GLOBEX}"]\n')
    d = DaemonProc(root / "data", "--tokens", str(tokens), "--token", ADMIN, host_mem="1MiB", disk="4MiB")
    yield d
    if d.proc.poll() is None:
        d.kill9()


def call(url: str, method: str = "GET", body: Any = None, token: str | None = None) -> tuple[int, Any]:
    return rest_call(url, method, body, token, timeout=60.0)  # forgets and prefetches can take a while


def put_chain(daemon: DaemonProc, token: str, salt: int, n: int) -> list[bytes]:
    with daemon.connect(token) as c:
        keys = c.block_keys(prompt(salt, n))
        c.put(keys, blocks(keys))
    return keys


# ------------------------------------------------------------------------------ pins


PINNER = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    from daemon_helpers import LAYOUT, prompt
    import kvstore
    c = kvstore.connect({url!r}, token={token!r}, layout=LAYOUT, model_id="test-model")
    keys = c.block_keys(prompt({salt}, 4))
    c.pin(keys[:2])                # no deadline: only the connection's end ends it
    c.pin(keys[2:], ttl_s=3600)    # a deadline far away
    print("pinned", flush=True)
    time.sleep(600)                # alive, pins held, until the test's kill -9
""")


def test_the_pins_of_a_client_killed_by_kill9_end_when_the_daemon_sees_it_go(daemon: DaemonProc) -> None:
    keys = put_chain(daemon, ACME, 11, 4)
    script = PINNER.format(tests=str(ROOT / "tests" / "daemon"), url=daemon.unix, token=ACME, salt=11)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "pinned"
        with daemon.connect(ACME) as watcher:
            assert [i.pins for i in watcher.inspect(keys)] == [1, 1, 1, 1]  # type: ignore[union-attr]
            child.send_signal(signal.SIGKILL)  # no close, no goodbye: the socket just goes
            child.wait(10)
            wait_until(lambda: [i.pins for i in watcher.inspect(keys)] == [0] * 4,  # type: ignore[union-attr]
                       20, "the killed client's pins ending")
            watcher.delete(keys)  # nothing holds them any more
    finally:
        child.kill()


def test_a_pin_with_a_ttl_ends_while_its_client_lives(daemon: DaemonProc) -> None:
    keys = put_chain(daemon, ACME, 12, 2)
    with daemon.connect(ACME) as c:
        c.pin(keys, ttl_s=1)
        info = c.inspect(keys)[0]
        assert info is not None and info.pins == 1 and 0 < info.pin_expires_s <= 1  # type: ignore[operator]
        wait_until(lambda: c.inspect(keys)[0].pins == 0, 10, "the pin's TTL")  # type: ignore[union-attr]
        with pytest.raises(ValueError, match="is not pinned by this connection"):
            c.unpin(keys)  # it ended by itself: nothing left to undo


def test_one_connection_cannot_undo_another_connections_pin(daemon: DaemonProc) -> None:
    keys = put_chain(daemon, ACME, 13, 1)
    with daemon.connect(ACME) as a, daemon.connect(ACME) as b:
        a.pin(keys)
        with pytest.raises(ValueError, match="not pinned by this connection"):
            b.unpin(keys)
        a.unpin(keys)
        assert b.inspect(keys)[0].pins == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("ttl", [0, -5, 86401, float("inf")])
def test_a_bad_ttl_is_refused_by_the_client_and_by_the_daemon(daemon: DaemonProc, ttl: float) -> None:
    keys = put_chain(daemon, ACME, 14, 1)
    with daemon.connect(ACME) as c:
        with pytest.raises(ValueError, match="ttl_s must be a number of seconds > 0 and at most 86400"):
            c.pin(keys, ttl_s=ttl)
        with pytest.raises(RemoteError, match="ttl_s must be") as err:  # past the client's own check
            c._call({"op": "pin", "keys": b"".join(keys), "ttl_s": ttl})
        assert err.value.code == Code.BAD_REQUEST
        assert c.inspect(keys)[0].pins == 0  # type: ignore[union-attr]


# ------------------------------------------------------------------------------ prefetch, inspect, delete


def test_prefetch_returns_a_handle_at_once_and_warms_host_ram(daemon: DaemonProc) -> None:
    keys = put_chain(daemon, ACME, 21, 3)
    with daemon.connect(ACME) as c:
        handle = c.prefetch(keys)
        assert handle.num_requested == 3
        assert handle.result(20) == 3 and handle.done()
        assert c.lookup(keys).tiers == ("host",) * 3
        assert c.prefetch(c.block_keys(prompt(22, 2))).result(20) == 0  # held nowhere
        with pytest.raises(ValueError, match=f"at most {MAX_KEYS} keys, got 10000000"):
            c.prefetch(keys[:1] * 10_000_000)
        with pytest.raises(RemoteError, match="keys in one request, the limit is") as err:
            c._call({"op": "prefetch", "keys": keys[0] * (c.max_keys + 1)})
        assert err.value.code == Code.BAD_REQUEST
        with pytest.raises(KeyError, match="no prefetch 999"):
            c._call({"op": "prefetch_status", "prefetch": 999})


def test_inspect_and_delete_with_descendants(daemon: DaemonProc) -> None:
    with daemon.connect(GLOBEX) as c:
        trunk = c.block_keys(prompt(31, 2))
        a = c.block_keys([*prompt(31, 2), *prompt(32, 2)])
        b = c.block_keys([*prompt(31, 2), *prompt(33, 3)])
        c.put(a, blocks(a))
        c.put(b, blocks(b))
        assert a[:2] == b[:2] == trunk
        info = c.inspect([*a, c.block_keys(prompt(34, 1))[0]])
        assert info[-1] is None
        first = info[0]
        assert first is not None and first.key == a[0] and first.tiers[0] == "host" and first.tenant == "globex"
        assert first.codecs["host"] == "none" and first.stored_bytes["host"] == LAYOUT.bytes_per_block
        assert c.delete(trunk[1:], descendants=True) == 1 + 2 + 3
        assert c.contains(a + b) == [True] + [False] * 3 + [True] + [False] * 4


# ------------------------------------------------------------------------------ tenants and admin


def test_a_tenant_token_acts_on_its_own_tenant_only_and_the_admin_on_any(daemon: DaemonProc) -> None:
    keys = put_chain(daemon, ACME, 41, 2)
    with daemon.connect(GLOBEX) as g:
        for op in ({"op": "inspect", "keys": b"".join(keys), "tenant": "acme"},
                   {"op": "pin", "keys": b"".join(keys), "tenant": "acme"},
                   {"op": "delete", "keys": b"".join(keys), "tenant": "acme"},
                   {"op": "forget", "tenant": "acme"}):
            with pytest.raises(RemoteError, match="needs the admin token") as err:
                g._call(dict(op))
            assert err.value.code == Code.AUTH
        assert g.inspect(keys) == [None, None]  # its own tenant: acme's keys name nothing of globex
    with daemon.connect(ADMIN) as admin:
        found = admin.inspect(keys, tenant="acme")
        assert [i.tenant for i in found] == ["acme", "acme"]  # type: ignore[union-attr]
        admin.pin(keys, ttl_s=60, tenant="acme")
        assert admin.inspect(keys, tenant="acme")[0].pins == 1  # type: ignore[union-attr]
        admin.unpin(keys, tenant="acme")
        with pytest.raises(KeyError, match="unknown tenant 'nobody'"):
            admin.inspect(keys, tenant="nobody")
        with pytest.raises(RemoteError, match="must name the tenant") as err:
            admin._call({"op": "forget"})
        assert err.value.code == Code.BAD_REQUEST
    with daemon.connect(ACME) as a:
        assert a.lookup(keys).num_blocks == 2  # nothing above changed acme's blocks


def test_a_tenant_forgets_itself_over_the_protocol(daemon: DaemonProc) -> None:
    acme = put_chain(daemon, ACME, 51, 3)
    globex = put_chain(daemon, GLOBEX, 51, 3)
    with daemon.connect(ACME) as a:
        a.pin(acme[:1])
        report = a.forget_tenant()
        assert report.tenant == "acme" and report.complete and report.num_blocks >= 3
        assert report.deleted["host"] >= 3 and report.pins_released == 1
        assert a.lookup(acme).num_blocks == 0
    with daemon.connect(GLOBEX) as g:
        assert torch.equal(g.get(globex), blocks(globex))


# ------------------------------------------------------------------------------ REST


def body(keys: list[bytes], **extra: Any) -> dict[str, Any]:
    return {"model": "test-model", "keys": [k.hex() for k in keys], **extra}


def test_rest_cache_routes_over_a_real_daemon(daemon: DaemonProc) -> None:
    keys = put_chain(daemon, ACME, 61, 3)
    url = f"{daemon.http}/v1/cache"
    assert call(f"{url}/inspect", "POST", body(keys))[0] == 401
    assert call(f"{url}/inspect", "POST", body(keys, tenant="acme"), GLOBEX)[0] == 403
    assert call(f"{url}/inspect", "POST", body(keys, tenant="nobody"), ADMIN)[0] == 404
    status, found = call(f"{url}/inspect", "POST", body(keys), ACME)
    assert status == 200 and found["tenant"] == "acme" and found["num_held"] == 3
    assert found["blocks"][0]["key"] == keys[0].hex() and "host" in found["blocks"][0]["tiers"]
    tokens = {"model": "test-model", "token_ids": prompt(61, 3)}  # the same blocks, by prompt
    assert call(f"{url}/inspect", "POST", tokens, ACME)[1]["num_held"] == 3
    assert call(f"{url}/inspect", "POST", tokens, GLOBEX)[1]["num_held"] == 0  # its own chain: nothing

    assert call(f"{url}/pin", "POST", body(keys), ACME)[0] == 422  # a REST pin needs a TTL
    assert call(f"{url}/pin", "POST", body(keys, ttl_s=0), ACME)[0] == 422
    assert call(f"{url}/pin", "POST", body(keys, ttl_s=86401), ACME)[0] == 422
    assert call(f"{url}/pin", "POST", body(keys, ttl_s=30), ACME) == (200, {"tenant": "acme", "pinned": 3,
                                                                             "ttl_s": 30.0})
    pinned = call(f"{url}/inspect", "POST", body(keys), ACME)[1]["blocks"]
    assert [b["pins"] for b in pinned] == [1, 1, 1] and 0 < pinned[0]["pin_expires_s"] <= 30
    assert call(f"{url}/delete", "POST", body(keys), ACME)[0] == 409  # pinned: nothing deleted
    assert call(f"{url}/unpin", "POST", body(keys), ACME) == (200, {"tenant": "acme", "unpinned": 3})
    assert call(f"{url}/unpin", "POST", body(keys), ACME)[0] == 400

    status, started = call(f"{url}/prefetch", "POST", body(keys), ACME)
    assert status == 202 and started["num_keys"] == 3
    wait_until(lambda: call(f"{daemon.http}{started['status']}", token=ACME)[1]["done"], 20, "the prefetch")
    assert call(f"{daemon.http}{started['status']}", token=ACME)[1]["num_blocks"] == 3
    assert call(f"{daemon.http}{started['status']}", token=GLOBEX)[0] == 404  # not its prefetch
    too_many = {"model": "test-model", "keys": [keys[0].hex()] * (MAX_KEYS + 1)}
    status, error = call(f"{url}/prefetch", "POST", too_many, ACME)
    assert status == 422 and "65536" in json.dumps(error)
    assert call(f"{url}/prefetch", "POST", {"model": "test-model", "keys": ["ab" * 16]}, ACME)[0] == 400  # 16 of 32 bytes

    assert call(f"{url}/delete", "POST", body(keys[1:], descendants=True), ACME) == (200, {"tenant": "acme",
                                                                                           "deleted": 2})
    assert call(f"{url}/forget", "POST", {"tenant": "acme"}, GLOBEX)[0] == 403
    status, report = call(f"{url}/forget", "POST", {"tenant": "acme"}, ACME)
    assert status == 200 and report["complete"] and report["tenant"] == "acme"
    assert call(f"{url}/inspect", "POST", body(keys), ACME)[1]["num_held"] == 0
