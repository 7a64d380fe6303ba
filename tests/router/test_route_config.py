"""RouteConfig and the replica info parser: bad input gets a clear error."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvstore.cli import main
from kvstore.errors import ConfigError
from kvstore.services.router.config import RouteConfig
from kvstore.services.router.policy import Router
from kvstore.services.router.replica import ReplicaLink, parse_info

INFO: dict[str, Any] = {
    "model": "random", "engine_id": "e1", "block_size": 16, "max_model_len": 4096,
    "namespace": {"model_id": "random:abc", "num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32",
                  "block_size": 16, "tp_rank": 0, "tp_size": 1, "hash_algo": "sha256"},
    "tokenizer": {"kind": "bytes"},
    "kv_events": {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", "topic": ""},
}


def test_route_config_rules() -> None:
    config = RouteConfig(("http://127.0.0.1:8001/", "http://127.0.0.1:8002"))
    assert config.urls == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    with pytest.raises(ConfigError, match="at least one --replica"):
        RouteConfig(())
    with pytest.raises(ConfigError, match="base URL"):
        RouteConfig(("127.0.0.1:8001",))
    with pytest.raises(ConfigError, match="base URL"):
        RouteConfig(("http://127.0.0.1:8001/v1",))
    with pytest.raises(ConfigError, match="once"):
        RouteConfig(("http://a:1", "http://a:1"))
    with pytest.raises(ConfigError, match="--tokens needs --router-token"):
        RouteConfig(("http://a:1",), tokens_file="t.toml")
    with pytest.raises(ConfigError, match="off loopback"):
        RouteConfig(("http://a:1",), host="0.0.0.0")
    assert "secret" not in repr(RouteConfig(("http://a:1",), router_token="secret"))


def test_parse_info_rebuilds_the_namespace() -> None:
    info = parse_info(INFO)
    assert info.block_size == 16 and info.tokenizer_kind == "bytes" and info.engine_id == "e1"
    assert info.namespace.model_id == "random:abc" and info.replay_endpoint == "tcp://127.0.0.1:5558"
    assert parse_info(INFO | {"kv_events": None}).events_endpoint is None
    with pytest.raises(ValueError, match="malformed /v1/kvstore/info"):
        parse_info({k: v for k, v in INFO.items() if k != "namespace"})
    with pytest.raises(ValueError, match="malformed"):
        parse_info(INFO | {"namespace": INFO["namespace"] | {"dtype": "float7"}})
    with pytest.raises(ValueError, match="malformed"):
        parse_info([1, 2])


@pytest.mark.parametrize("events", [{"endpoint": "not-an-endpoint", "replay_endpoint": None},
                                    {"endpoint": "tcp://127.0.0.1:5999", "replay_endpoint": "bogus"}])
def test_a_replica_naming_an_unusable_events_endpoint_is_routed_without_events(events: dict[str, Any]) -> None:
    info = parse_info({**INFO, "kv_events": {**events, "topic": ""}})
    link = ReplicaLink("http://127.0.0.1:8001", {}, health_interval_s=0.5, dead_after_s=2.0)
    link.info = info
    router = Router(info.block_size)
    router.add_replica(link.url)
    link._start_events(router)  # as the health loop does when it takes the replica in, then:
    link.healthy = True
    assert link.subscriber is None
    assert link.status(router)["mode"] == "approximate"  # routed from the router's own history


def test_the_same_replica_twice_is_refused_however_it_is_spelled() -> None:
    with pytest.raises(ConfigError, match="once"):
        RouteConfig(("http://a:1", "http://a:1/"))


def test_off_loopback_needs_a_tokens_file_that_names_a_token(tmp_path: Any) -> None:
    empty = tmp_path / "empty.toml"
    empty.write_text("# no [[tenant]] tables yet\n")
    # refused by the router's rule, or by the tokens reader itself: never served open
    with pytest.raises(ConfigError, match=f"{re.escape(str(empty))}.* no token"):
        RouteConfig(("http://a:1",), host="0.0.0.0", tokens_file=str(empty), router_token="secret")
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[[tenant]]\nname = "acme"\ntokens = ["tok-acme"]\n')
    assert RouteConfig(("http://a:1",), host="0.0.0.0", tokens_file=str(tokens), router_token="secret").port == 8000
    with pytest.raises(ConfigError, match="cannot read tokens file"):
        RouteConfig(("http://a:1",), host="0.0.0.0", tokens_file=str(tmp_path / "missing.toml"), router_token="s")


@pytest.mark.parametrize("port", ["70000", "-1", "eighty"])
def test_a_bad_port_is_a_usage_error(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["route", "--replica", "http://127.0.0.1:1", "--port", port])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"--port: must be a port in 0-65535, got '{port}'" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="--port must be in 0-65535"):
        RouteConfig(("http://a:1",), port=int(port) if port != "eighty" else 65536)
