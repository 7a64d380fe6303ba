"""``kvstore serve --disk-codec int8``: a real daemon whose disk tier holds int8 blocks; REST
says so; gets return decoded values; the slab's slots are the encoded size."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout
from kvstore.errors import ConfigError
from kvstore.services.daemon.config import load_config

from daemon_helpers import DaemonProc, blocks, prompt

# 32 KiB fp16 blocks: 8 pages raw, 5 pages as int8 (16,928 bytes).
CODEC_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)


def _get(url: str) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(url, timeout=20) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def test_daemon_with_an_int8_disk(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "data", "--disk-codec", "int8", host_mem="1MiB", disk="2MiB")
    try:
        tiers = _get(f"{d.http}/v1/tiers")["tiers"]
        assert tiers["disk"]["codec"] == "int8" and tiers["disk"]["lossy"] is True
        assert tiers["host"]["codec"] == "none" and tiers["host"]["lossy"] is False
        with d.connect(layout=CODEC_LAYOUT) as client:
            keys = client.block_keys(prompt(3, 30, CODEC_LAYOUT.block_size))
            data = blocks(keys, CODEC_LAYOUT)
            client.put(keys, data)  # write-through: every block also goes to the int8 disk
            body = json.dumps({"model": "test-model", "token_ids": prompt(3, 30, CODEC_LAYOUT.block_size)}).encode()
            req = urllib.request.Request(f"{d.http}/v1/lookup", data=body, headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=20) as r:
                looked = json.loads(r.read())
            num_disk = client.lookup(keys).tiers.count("disk")  # the host copies are the bytes put
            assert num_disk > 0 and looked["lossy_tokens"] == num_disk * CODEC_LAYOUT.block_size
            got = client.get(keys[:2])  # heads: still in host RAM, the bytes put
            assert torch.equal(got, data[:2])
            stats = client.stats()
            assert stats["disk"]["codec"] == "int8" and stats["disk"]["num_blocks"] == 25  # 512 KiB / 20 KiB
            on_disk = [k for k in keys if client.lookup([k]).tiers == ("disk",)]
            assert on_disk
            row = keys.index(on_disk[0])
            decoded = client.get([on_disk[0]])
            err = (decoded.float() - data[row : row + 1].float()).abs()
            amax = data[row : row + 1].float().abs().amax(dim=-1, keepdim=True)
            assert bool((err <= amax / 254 * 1.01 + amax * 2**-11).all()) and float(err.max()) > 0
        spaces = _get(f"{d.http}/v1/namespaces")["namespaces"]
        assert spaces[0]["codecs"]["disk"]["codec"] == "int8" and spaces[0]["codecs"]["disk"]["block_bytes"] == 20480
        slab = next((tmp_path / "data" / "namespaces").glob("*/disk/slab-000.bin"))
        assert slab.stat().st_size == 25 * 20480  # the real stored length: 20 KiB slots, not 32
        assert d.stop() == 0
    finally:
        if d.proc.poll() is None:
            d.kill9()


def test_daemon_with_disk_codec_auto_measures_each_namespaces_disk(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "data", "--disk-codec", "auto", host_mem="1MiB", disk="2MiB")
    try:
        assert _get(f"{d.http}/v1/tiers")["tiers"]["disk"]["codec"] == "auto"  # before any namespace opens
        with d.connect(layout=CODEC_LAYOUT) as client:
            keys = client.block_keys(prompt(3, 30, CODEC_LAYOUT.block_size))
            client.put(keys, blocks(keys, CODEC_LAYOUT))
            stats = client.stats()["disk"]
            chosen = stats["codec"]
            assert chosen in ("none", "int8")
            # the namespace's 512 KiB disk share in slots of the chosen size: 20 KiB int8, 32 KiB raw
            assert stats["num_blocks"] == (25 if chosen == "int8" else 16)
        record = next((tmp_path / "data" / "namespaces").glob("*/disk/codec-choice.json"))
        assert json.loads(record.read_text())["codec"] == chosen
        spaces = _get(f"{d.http}/v1/namespaces")["namespaces"]
        assert spaces[0]["codecs"]["disk"]["codec"] == chosen
        assert d.stop() == 0
    finally:
        if d.proc.poll() is None:
            d.kill9()


def test_disk_codec_from_toml_and_bad_values(tmp_path: Path) -> None:
    toml = tmp_path / "kvstore.toml"
    toml.write_text('disk_codec = "fp8"\n')
    assert load_config(toml, {"data_dir": tmp_path}).store_settings.disk_codec == "fp8"
    assert load_config(toml, {"data_dir": tmp_path, "disk_codec": "int8"}).store_settings.disk_codec == "int8"  # flags win
    toml.write_text('disk_codec = "zstd"\n')
    with pytest.raises(ConfigError, match=r"disk_codec must be one of \['none', 'int8', 'int8-fp32', 'fp8', 'int4-rot', 'int4-norot', 'auto'\]"):
        load_config(toml, {"data_dir": tmp_path})
