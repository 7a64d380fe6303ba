"""An engine whose device pool holds quantized pages (``kv_cache_dtype="int8"``/``"fp8"``): the
same ``kv_cache_bytes`` holds ~1.9x the tokens of float16; a demoted block comes back from host
and disk bit for bit; its pages live in a namespace of their own (no other pool format, restart
included, ever reads them); a float pool of another dtype than the model's works; the engine
says what its pool holds (KV events' media). Output quality on the real model is measured by
``kvstore bench quality`` and tests/engine/test_quantized_pool_smollm2.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore import ConfigError, LayoutMismatchError, StoreSettings
from kvstore.engine import LLMEngine, SamplingParams
from kvstore.events import Subscriber
from kvstore.kernels import unpack_rows
from kvstore.tiers.errors import TierError
from tests.daemon.daemon_helpers import DaemonProc

MODEL = dict(num_layers=2, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
             vocab_size=256, max_position_embeddings=1024)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = list(range(5, 5 + 100))  # 6 full blocks of 16 and 4 tokens


def engine(kv_cache_dtype: str, **kwargs: object) -> LLMEngine:
    opts: dict[str, object] = dict(random_model=MODEL, kv_cache_bytes=4 << 20, kv_cache_dtype=kv_cache_dtype,
                                   fetch_policy="always")
    opts.update(kwargs)
    if "store_settings" not in opts and "host_bytes" not in opts:
        opts["host_bytes"] = 8 << 20
    return LLMEngine(None, **opts)  # type: ignore[arg-type]


def test_int8_and_fp8_pages_hold_nearly_twice_the_tokens_of_float16() -> None:
    blocks = {}
    for dtype in ("float32", "float16", "int8", "fp8"):
        with engine(dtype, host_bytes=0) as llm:
            blocks[dtype] = llm.pool.num_blocks
            assert llm.kv_cache_dtype == dtype
    # head_dim 64: a head row is 64 codes + a 2-byte scale = 66 bytes, against 128 in float16
    assert blocks["int8"] == blocks["fp8"] == (4 << 20) // (2 * 2 * 16 * 2 * 66)
    assert blocks["int8"] / blocks["float16"] >= 1.9 and blocks["int8"] / blocks["float32"] >= 3.8


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_a_demoted_page_comes_back_bit_for_bit_from_host_and_disk(kv_cache_dtype: str, tmp_path: Path) -> None:
    tiers = dict(host_bytes=8 << 20, disk_path=tmp_path / "disk", disk_bytes=16 << 20)
    with engine(kv_cache_dtype, **tiers) as llm:
        first = llm.generate([PROMPT], GREEDY)[0]
        keys = llm.store.block_keys(PROMPT)  # type: ignore[union-attr]
        table = [llm.block_manager.cached[k] for k in keys]
        pages = llm.pool.pool[table].clone()  # the prompt's 6 pages as the device held them
        assert pages.dtype == torch.uint8
        stored = llm.store.get(keys)  # type: ignore[union-attr]
        assert torch.equal(stored, pages)  # what the store keeps is the pages' bytes as they are
        assert llm.store.lookup(keys).lossy == (False,) * 6  # type: ignore[union-attr]  # the bytes put
        llm.evict_device_cache()
        again = llm.generate([PROMPT], GREEDY)[0]
        assert again.metrics.cached_tokens["host"] == 96 and again.token_ids == first.token_ids
        back = [llm.block_manager.cached[k] for k in keys]
        assert torch.equal(llm.pool.pool[back], pages)
    with engine(kv_cache_dtype, **tiers) as llm:  # a restart: the disk's copy
        out = llm.generate([PROMPT], GREEDY)[0]
        assert out.metrics.cached_tokens["disk"] == 96 and out.token_ids == first.token_ids
        assert torch.equal(llm.pool.pool[[llm.block_manager.cached[k] for k in keys]], pages)


def test_a_disk_tier_of_one_pool_format_refuses_another_at_restart(tmp_path: Path) -> None:
    tiers = dict(host_bytes=8 << 20, disk_path=tmp_path / "disk", disk_bytes=32 << 20)
    with engine("int8", **tiers) as llm:
        first = llm.generate([PROMPT], GREEDY)[0]
    for other in ("fp8", "float32", "float16"):  # another namespace: a clear error, nothing read or deleted
        with pytest.raises(TierError, match="use another path or delete the directory"):
            engine(other, **tiers)
    with engine("int8", **tiers) as llm:
        out = llm.generate([PROMPT], GREEDY)[0]
        assert out.metrics.cached_tokens["disk"] == 96 and out.token_ids == first.token_ids


def test_pool_formats_sharing_a_daemon_never_share_blocks(tmp_path: Path) -> None:
    daemon = DaemonProc(tmp_path / "data", host_mem="64MiB", disk="64MiB")
    try:
        found = {}
        namespaces = set()
        for dtype in ("int8", "fp8", "auto", "int8"):
            with engine(dtype, host_bytes=0, store_url=daemon.unix) as llm:
                out = llm.generate([PROMPT], GREEDY)[0]
                found.setdefault(dtype, []).append(out.metrics.cached_tokens["host"])
                namespaces.add(llm.namespace.id)
                assert llm.namespace.model_id.endswith(f"+kv-{dtype}") == (dtype != "auto")
        assert found == {"int8": [0, 96], "fp8": [0], "auto": [0]}  # only the second int8 engine hits
        assert len(namespaces) == 3
    finally:
        daemon.stop()


def test_a_float16_pool_under_a_float32_model_stores_rounded_rows() -> None:
    with engine("float16") as half, engine("auto") as full:
        assert half.pool.pool.dtype == torch.float16 and full.pool.pool.dtype == torch.float32
        a, b = half.generate([PROMPT], GREEDY)[0], full.generate([PROMPT], GREEDY)[0]
        assert len(a.token_ids) == len(b.token_ids) == 8
        half.evict_device_cache()
        again = half.generate([PROMPT], GREEDY)[0]
        assert again.metrics.cached_tokens["host"] == 96 and again.token_ids == a.token_ids


def test_the_pool_format_is_in_the_kv_events_media() -> None:
    with engine("fp8", kv_events="tcp://127.0.0.1:*") as llm:
        assert llm.kv_events is not None
        info = llm.kv_events.info()
        assert info["media"]["GPU"]["kv_cache_dtype"] == "fp8"
        assert info["media"]["GPU"]["block_bytes"] == llm.layout.bytes_per_block
        sub = Subscriber(info["endpoint"], replay_endpoint=info["replay_endpoint"])
        try:
            sub.poll(1.0)  # the first poll takes a snapshot, which carries the media
            assert sub.media == {"GPU": {"kv_cache_dtype": "fp8", "block_bytes": llm.layout.bytes_per_block}}
        finally:
            sub.close()


@pytest.mark.parametrize("bad", ["int4", "float64", "", None])
def test_an_unknown_pool_format_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        engine(bad)  # type: ignore[arg-type]


def test_a_tier_with_another_codec_converts_pages_once_at_its_boundary(tmp_path: Path) -> None:
    # int8 pages: host keeps them as they are (its codec is the pages' own), the disk converts
    # them to fp8 on the way down and back into int8 pages on the way up
    tiers = dict(host_bytes=8 << 20, disk_path=tmp_path / "disk", disk_bytes=16 << 20,
                 store_settings=StoreSettings(host_codec="int8", disk_codec="fp8"))
    with engine("int8", **tiers) as llm:
        first = llm.generate([PROMPT], GREEDY)[0]
        keys = llm.store.block_keys(PROMPT)  # type: ignore[union-attr]
        pages = llm.store.get(keys)  # type: ignore[union-attr]
        codecs = llm.store.view.codecs()  # type: ignore[union-attr]
        assert codecs["host"]["codec"] == "none" and codecs["disk"]["codec"] == "fp8"
        assert codecs["disk"]["converts_pages"] == "int8"
    with engine("int8", **tiers) as llm:  # a restart: only the disk's fp8 copy is left
        match = llm.store.lookup(keys)  # type: ignore[union-attr]
        assert match.tiers == ("disk",) * 6 and match.lossy == (True,) * 6
        back = llm.store.get(keys)  # type: ignore[union-attr]
        assert back.dtype == torch.uint8 and back.shape == pages.shape
        with pytest.raises(KeyError):
            llm.store.get(keys, exact=True)  # type: ignore[union-attr]
        values = [unpack_rows(b.view(-1, 2, 66), torch.int8) for b in (pages, back)]
        amax = values[0].abs().amax()
        assert (values[1] - values[0]).abs().max() <= amax / 16  # two roundings: fp8 then int8
        out = llm.generate([PROMPT], GREEDY)[0]  # the get promoted the converted pages into host RAM
        assert out.metrics.cached_tokens["host"] == 96 and len(out.token_ids) == len(first.token_ids)


def test_a_daemon_whose_tier_cannot_keep_pages_refuses_them_clearly(tmp_path: Path) -> None:
    daemon = DaemonProc(tmp_path / "data", "--disk-codec", "int8", host_mem="64MiB", disk="64MiB")
    try:
        with pytest.raises(LayoutMismatchError, match="this daemon's disk_codec='int8' cannot hold blocks"):
            engine("int8", host_bytes=0, store_url=daemon.unix)
        with engine("auto", host_bytes=0, store_url=daemon.unix) as llm:  # values: the daemon's int8 tier takes them
            assert llm.generate([PROMPT], GREEDY)[0].token_ids
    finally:
        daemon.stop()
