"""disk_codec="auto" (kvstore/store/levels/codec_choice.py): measured on the real filesystem of
the test's directory, the choice recorded and kept across opens, the decision rule at both
ends, the layouts it cannot compress, a probe that cannot write, and the settings it refuses."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout, StoreConfig, TieredStore
from kvstore.errors import ConfigError
from kvstore.store.levels import codec_choice
from kvstore.store.levels.codec_choice import CHOICE_FILE, resolve_disk_codec

from codec_testing import int8_bound, random_kv

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)


def _config(tmp_path: Path, **overrides: object) -> StoreConfig:
    kwargs: dict[str, object] = {"layout": LAYOUT, "model_id": "auto-test", "host_bytes": 2 * LAYOUT.bytes_per_block,
                                 "disk_path": tmp_path / "disk", "disk_bytes": 64 * LAYOUT.bytes_per_block,
                                 "disk_codec": "auto", "sync_disk": False}
    kwargs.update(overrides)
    return StoreConfig(**kwargs)  # type: ignore[arg-type]


def test_auto_measures_records_and_serves_blocks_under_its_choice(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvstore.store"):
        store = TieredStore(_config(tmp_path))
    record = json.loads((tmp_path / "disk" / CHOICE_FILE).read_text())
    chosen = store.config.settings.disk_codec
    assert chosen in ("none", "int8") and record["codec"] == chosen
    assert record["blocks"] >= codec_choice.MIN_BLOCKS and record["raw_ms"] > 0 and record["int8_ms"] > 0
    # the rule, on the figures recorded
    assert (chosen == "int8") == (record["raw_ms"] >= codec_choice.MIN_GAIN * record["int8_ms"])
    assert f"disk_codec=auto chose {chosen}" in caplog.text
    assert store.view.codecs()["disk"]["codec"] == chosen
    assert [p.name for p in tmp_path.iterdir()] == ["disk"], "the probe's scratch tiers were left behind"
    keys = store.block_keys(list(range(6 * LAYOUT.block_size)))
    blocks = random_kv(LAYOUT, 6, seed=3)
    store.put(keys, blocks)
    store.close()
    store = TieredStore(_config(tmp_path, host_bytes=LAYOUT.bytes_per_block))  # five of six on disk only
    got = store.get(keys)
    if chosen == "none":
        assert torch.equal(got, blocks)
    else:
        assert bool(((got.float() - blocks.float()).abs() <= int8_bound(blocks, LAYOUT.dtype)).all())
    store.check_integrity()
    store.close()


@pytest.mark.parametrize(("min_gain", "expected"), [(0.0, "int8"), (float("inf"), "none")])
def test_the_rule_at_both_ends_and_the_record_wins_at_the_next_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     min_gain: float, expected: str) -> None:
    monkeypatch.setattr(codec_choice, "MIN_GAIN", min_gain)  # any measurement picks int8 (0) or none (inf)
    assert resolve_disk_codec(_config(tmp_path)).settings.disk_codec == expected

    def never(config: StoreConfig) -> tuple[str, dict[str, object]]:
        raise AssertionError("a directory with a recorded choice was measured again")

    monkeypatch.setattr(codec_choice, "measure", never)
    store = TieredStore(_config(tmp_path))
    assert store.config.settings.disk_codec == expected
    store.close()


def test_a_named_codec_is_never_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec_choice, "measure", lambda config: pytest.fail("measured a named codec"))
    for name in ("none", "int8", "int4-rot"):
        config = _config(tmp_path / name, disk_codec=name)
        (tmp_path / name).mkdir()
        assert resolve_disk_codec(config) is config
    assert not list(tmp_path.rglob(CHOICE_FILE))


def test_an_unreadable_record_is_an_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "disk").mkdir()
    record = tmp_path / "disk" / CHOICE_FILE
    for text in ("{not json", json.dumps({"codec": "int4-rot"}), json.dumps(["int8"])):
        record.write_text(text)
        with pytest.raises(ConfigError, match=CHOICE_FILE):
            TieredStore(_config(tmp_path))


def test_quantized_pages_stay_as_they_are_unmeasured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pages = KVLayout(num_layers=2, num_kv_heads=2, head_dim=66, block_size=16, dtype=torch.uint8)
    config = _config(tmp_path, layout=pages, pages="int8", disk_bytes=8 * pages.bytes_per_block,
                     host_bytes=2 * pages.bytes_per_block)
    assert resolve_disk_codec(config).settings.disk_codec == "none"
    record = json.loads((tmp_path / "disk" / CHOICE_FILE).read_text())
    assert record["codec"] == "none" and "cannot store" in record["reason"]


def test_a_probe_that_cannot_write_opens_raw_and_records_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    import kvstore.tiers.slab as slab_module

    def failing(fd: int, buffers: list[memoryview], offset: int) -> int:
        raise OSError(errno.EIO, "injected media error")

    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, logger="kvstore.store"):
        patch.setattr(slab_module.os, "pwritev", failing)
        resolved = resolve_disk_codec(_config(tmp_path))
    assert resolved.settings.disk_codec == "none"
    assert "could not measure" in caplog.text
    assert not (tmp_path / "disk" / CHOICE_FILE).exists()
    assert [p.name for p in tmp_path.iterdir()] in ([], ["disk"]), "the probe's scratch tiers were left behind"
    store = TieredStore(_config(tmp_path))  # the filesystem works again: measured now
    assert (tmp_path / "disk" / CHOICE_FILE).exists()
    store.close()


def test_auto_is_refused_where_it_cannot_apply(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="host_codec must be one of"):
        _config(tmp_path, host_codec="auto")
    with pytest.raises(ConfigError, match="remote_codec must be one of"):
        _config(tmp_path, remote_codec="auto")
    with pytest.raises(ConfigError, match="name the disk's codec"):
        _config(tmp_path, host_codec="int8")
    config = _config(tmp_path)  # until the store chooses, a slot is sized as a raw block's
    assert config.tier_slot_bytes("disk") == config.slot_bytes
