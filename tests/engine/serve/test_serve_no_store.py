""""Do not store" on ``kvstore engine``, driven by the official openai client: a request with
the body extension ``"kvstore": {"store": false}`` or the ``X-KVStore-No-Store`` header leaves
none of its blocks in a real ``kvstore serve`` daemon, not even after the engine writes its
device cache back on SIGTERM, while it still reads the prefix others stored."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.daemon.daemon_helpers import DaemonProc

from serve_helpers import BLOCK, EngineServer


def prompt(salt: int) -> list[int]:
    return [salt * 7 + i for i in range(12 * BLOCK + 1)]  # 12 full cacheable blocks


def held(daemon: DaemonProc, model_id: str, tokens: list[int]) -> int:
    r = httpx.post(f"{daemon.http}/v1/lookup", json={"model": model_id, "token_ids": tokens}, timeout=10)
    assert r.status_code == 200, r.text
    return int(r.json()["num_blocks"])


def test_a_request_that_says_do_not_store_leaves_nothing_behind(tmp_path: Path) -> None:
    daemon = DaemonProc(tmp_path / "data", host_mem="8MiB", disk="16MiB")
    server = EngineServer("--store-url", daemon.unix, "--device-write-policy", "write_through")
    try:
        client = server.client()
        model_id = httpx.get(f"{server.url}/v1/kvstore/info").json()["namespace"]["model_id"]
        by_body, by_header, stored = prompt(1), prompt(2), prompt(3)
        client.completions.create(model="random", prompt=by_body, max_tokens=2, temperature=0,
                                  extra_body={"kvstore": {"store": False}})
        client.with_options(default_headers={"X-KVStore-No-Store": "1"}).completions.create(
            model="random", prompt=by_header, max_tokens=2, temperature=0)
        client.completions.create(model="random", prompt=stored, max_tokens=2, temperature=0,
                                  extra_body={"kvstore": {"store": True}})
        # a no-store request still reads what others stored (here from the device cache)
        reread = client.completions.create(model="random", prompt=stored, max_tokens=2, temperature=0,
                                           extra_body={"kvstore": {"store": False}})
        assert reread.usage.prompt_tokens_details.cached_tokens == 12 * BLOCK  # type: ignore[union-attr]
        chat = client.chat.completions.create(model="random", messages=[{"role": "user", "content": "hi " * 20}],
                                              max_tokens=2, extra_body={"kvstore": {"store": False}})
        assert chat.choices[0].message.content is not None

        with pytest.raises(openai.BadRequestError, match="kvstore"):
            client.completions.create(model="random", prompt=stored, max_tokens=2,
                                      extra_body={"kvstore": {"stor": False}})  # a misspelt option
        with pytest.raises(openai.BadRequestError, match="X-KVStore-No-Store"):
            client.with_options(default_headers={"X-KVStore-No-Store": "perhaps"}).completions.create(
                model="random", prompt=stored, max_tokens=2)
        server.wait_idle()
        assert server.stop() == 0  # SIGTERM: the device cache is written back to the daemon
        assert held(daemon, model_id, stored) == 12
        assert held(daemon, model_id, by_body) == 0
        assert held(daemon, model_id, by_header) == 0
    finally:
        server.kill()
        daemon.kill9()
