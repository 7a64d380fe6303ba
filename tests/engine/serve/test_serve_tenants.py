"""Tenants of ``kvstore engine --tokens FILE --router-token SECRET`` (here the secret comes from
KVSTORE_ROUTER_TOKEN, off the command line): a Bearer token names the tenant, the tenant salts
the keys, so tenants never see each other's cached tokens; a router names the tenant in
X-KVStore-Tenant only with the router token; off loopback needs tokens; secrets stay out of
logs, errors, metrics and the config's repr."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvstore.config import StoreSettings
from kvstore.services.engine_server.config import EngineServerConfig

from serve_helpers import BLOCK, ROOT, EngineServer

PROMPT = [11 + i for i in range(10 * BLOCK + 1)]  # 10 full cacheable blocks
ROUTER = "router-secret-1234"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tokens = tmp_path_factory.mktemp("tenants") / "tokens.toml"
    tokens.write_text('[[tenant]]\nname = "acme"\ntokens = ["tok-acme"]\n\n'
                      '[[tenant]]\nname = "globex"\ntokens = ["tok-globex", "tok-globex-2"]\n')
    srv = EngineServer("--tokens", str(tokens), env={"KVSTORE_ROUTER_TOKEN": ROUTER})
    yield srv
    srv.kill()


def cached(client: Any, prompt: list[int] = PROMPT, **kw: Any) -> int:
    r = client.completions.create(model="random", prompt=prompt, max_tokens=2, temperature=0, **kw)
    return int(r.usage.prompt_tokens_details.cached_tokens)


def test_tenants_never_see_each_others_cache(server: EngineServer) -> None:
    acme, globex = server.client("tok-acme"), server.client("tok-globex")
    assert cached(acme) == 0
    assert cached(acme) == 10 * BLOCK  # acme's own prefix
    assert cached(globex) == 0  # the same prompt, another tenant: nothing shared
    assert cached(server.client("tok-globex-2")) == 10 * BLOCK  # the same tenant by another token


def test_router_names_the_tenant_only_with_its_token(server: EngineServer) -> None:
    prompt = [200 + i for i in range(6 * BLOCK + 1)]
    assert cached(server.client("tok-acme"), prompt) == 0
    router = server.client(ROUTER)
    assert cached(router, prompt, extra_headers={"X-KVStore-Tenant": "acme"}) == 6 * BLOCK
    assert cached(router, prompt, extra_headers={"X-KVStore-Tenant": "globex"}) == 0
    assert cached(router, prompt) == 0  # the router's own tenant "" shares nothing either
    with pytest.raises(openai.PermissionDeniedError):  # a tenant cannot pose as another
        cached(server.client("tok-globex"), prompt, extra_headers={"X-KVStore-Tenant": "acme"})


def test_bad_tokens_get_401_and_secrets_stay_out(server: EngineServer) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
        assert "nope" not in r.text and "tok-" not in r.text
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").models.list()
    assert httpx.get(f"{server.url}/v1/kvstore/info").status_code == 401
    assert httpx.get(f"{server.url}/v1/kvstore/info", headers={"Authorization": f"Bearer {ROUTER}"}).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics stay open
    metrics = httpx.get(f"{server.url}/metrics").text
    assert ROUTER not in metrics and "tok-acme" not in metrics and ROUTER not in server.output


def test_secrets_stay_out_of_the_config_repr() -> None:
    config = EngineServerConfig(store_url="unix:///tmp/kvstore.sock", store_token="store-secret-42", router_token=ROUTER)
    embedded = EngineServerConfig(router_token=ROUTER,
                           store_settings=StoreSettings(remote_url="redis://:pw-secret@127.0.0.1:6379"))
    assert config.router_token == ROUTER and embedded.store_settings.remote_url is not None
    text = repr(config) + repr(embedded)
    assert "store-secret-42" not in text and ROUTER not in text and "pw-secret" not in text


def test_off_loopback_without_tokens_is_refused(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_ROUTER_TOKEN"}  # a token would let it bind
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "engine", "--random-model", "--host", "0.0.0.0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "off loopback" in proc.stderr


def test_a_taken_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "engine", "--random-model", "--port", port],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr, proc.stderr


def test_a_store_daemon_that_does_not_answer_is_a_clear_error(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "engine", "--random-model", "--port", "0",
                           "--store-url", "unix://nothing.sock"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("kvstore engine: ") and "Traceback" not in proc.stderr
    assert f"tried the socket {tmp_path / 'nothing.sock'}" in proc.stderr and "is `kvstore serve` running?" in proc.stderr


def test_the_tokens_files_tenants_get_equal_soft_shares_of_the_embedded_store(tmp_path: Path) -> None:
    from kvstore.services.engine_server.config import EngineServerConfig
    from kvstore.services.engine_server.server import build_state

    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[[tenant]]\nname = "acme"\ntokens = ["tok-acme"]\n\n'
                      '[[tenant]]\nname = "globex"\ntokens = ["tok-globex"]\n')
    state = build_state(EngineServerConfig(model=None, random_config={"num_layers": 1}, tokens_file=str(tokens),
                                    kv_cache_bytes=1 << 20))
    try:
        store = state.loop.llm.store
        assert store is not None
        table = store.quotas  # type: ignore[attr-defined]
        assert sorted(table.tenants) == ["acme", "globex"]
        for quotas in table.tenants.values():
            (quota,) = quotas.values()
            assert quota.soft is not None and quota.soft.share == 0.5 and quota.hard is None
    finally:
        state.loop.stop()
        state.loop.llm.close()
