"""Daemon addresses: ``unix://`` paths relative to the working directory, and errors that say
what was tried."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import kvstore
from kvstore.client.client import parse_address
from kvstore.engine import LLMEngine, SamplingParams

from daemon_helpers import LAYOUT, DaemonProc, blocks, daemon_fixture, prompt  # noqa: F401


def test_parse_address_forms() -> None:
    assert parse_address("unix:///run/kv.sock") == ("unix", "/run/kv.sock")
    assert parse_address("unix://.kvstore/kvstore.sock") == ("unix", ".kvstore/kvstore.sock")
    assert parse_address("unix://kv.sock") == ("unix", "kv.sock")
    assert parse_address("tcp://127.0.0.1:7470") == ("tcp", ("127.0.0.1", 7470))
    assert parse_address("tcp://[::1]:7470/") == ("tcp", ("::1", 7470))
    for bad in ("unix://", "tcp://host", "tcp://:80", "tcp://h:0", "http://h:1", "kv.sock"):
        with pytest.raises(ValueError, match="unix://PATH"):
            parse_address(bad)


def test_relative_socket_path_from_the_working_directory(daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    sock = Path(daemon.unix[len("unix://"):])
    monkeypatch.chdir(sock.parent.parent)
    url = f"unix://{sock.parent.name}/{sock.name}"  # e.g. unix://kvd-xyz/s
    with kvstore.connect(url, layout=LAYOUT, model_id="test-model") as client:
        keys = client.block_keys(prompt(3, 4))
        client.put(keys, blocks(keys))
        assert torch.equal(client.get(keys), blocks(keys))
    tiny = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=100,
                intermediate_size=96)
    with LLMEngine(None, store_url=url, block_size=4, kv_cache_bytes=64 * 2048, random_model=tiny) as llm:
        out = llm.generate([list(range(20))], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
        assert len(out.token_ids) == 2


def test_missing_socket_error_names_the_path_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        kvstore.connect("unix://.kvstore/kvstore.sock", layout=LAYOUT, model_id="m")
    message = str(info.value)
    assert os.path.join(str(tmp_path), ".kvstore", "kvstore.sock") in message
    assert "unix://.kvstore/kvstore.sock" in message and "kvstore serve" in message
    assert isinstance(info.value, kvstore.DaemonUnreachableError) and info.value.errno == errno.ENOENT
    with pytest.raises(ConnectionRefusedError, match=r"tried 127\.0\.0\.1:1\b") as refused:
        kvstore.connect("tcp://127.0.0.1:1", layout=LAYOUT, model_id="m")
    assert isinstance(refused.value, kvstore.DaemonUnreachableError)
