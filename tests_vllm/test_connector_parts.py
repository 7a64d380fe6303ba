"""Connector parts checked against vLLM's own types, without running a model: the namespace
from vLLM's KV cache specs and parallel layout, the hit sources vLLM's stats ask for, and the
CUDA-graph mode the connector asks vLLM for."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.errors import ConfigError
from kvstore.integrations.vllm.connector import KVStoreConnector, hit_sources
from kvstore.integrations.vllm.identity import model_identity

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)


def configs(spec: Any = FULL, tp: int = 1, pp: int = 1, rank: int = 0, **parallel: int) -> tuple[Any, Any]:
    """(vllm_config, kv_cache_config) as a worker of that rank sees them (the parts identity reads)."""
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="org/model", revision=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, rank=rank, **parallel))
    return vllm_config, KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


def test_each_pipeline_stage_and_tensor_rank_has_a_namespace_of_its_own() -> None:
    ids = {(tp_rank, pp_rank): model_identity(*configs(tp=2, pp=2, rank=pp_rank * 2 + tp_rank))
           for tp_rank in (0, 1) for pp_rank in (0, 1)}
    # both stages hold two layers: before, the stages' layouts and model ids were equal
    assert len({(i.model_id, i.layout.fingerprint()) for i in ids.values()}) == 4
    assert ids[0, 1].model_id.endswith(":pp1of2") and ids[1, 1].layout.tp_rank == 1
    assert ids[0, 0].model_id == model_identity(*configs(tp=2, pp=2, rank=0)).model_id  # the scheduler's view
    # one stage keeps the model id it always had: its stored blocks stay valid
    assert model_identity(*configs()).model_id == "vllm:org/model@-:FullAttentionSpec:head8:pp1"


def test_vllms_hybrid_groups_map_to_kvstore_groups() -> None:
    """vLLM's own specs of a hybrid model (hybrid KV cache manager on): a sliding-window group and
    a full-attention one become kvstore's KV groups, in vLLM's group order."""
    from kvstore.layout import FULL as FULL_KIND
    from kvstore.layout import SLIDING, KVGroup

    sliding = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16, sliding_window=64)
    vllm_config, _ = configs()
    kv_cache_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([LAYERS[0]], sliding), KVCacheGroupSpec([LAYERS[1]], FULL)])
    ident = model_identity(vllm_config, kv_cache_config)
    assert ident.layout.groups == (KVGroup(SLIDING, (0,), 64), KVGroup(FULL_KIND, (1,)))
    assert ident.group_layers == ((LAYERS[0],), (LAYERS[1],)) and ident.layout.num_layers == 1
    assert ident.model_id == "vllm:org/model@-:SlidingWindowSpec+FullAttentionSpec:head8:pp1"


@pytest.mark.parametrize(("spec", "match"), [
    (FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16, sliding_window=64),
     "FullAttentionSpec, window 64"),  # a hybrid model with vLLM's hybrid allocator off
    (MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float16), "MLA"),
    (FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16, non_causal=True),
     "non-causal"),
])
def test_models_other_than_plain_full_attention_are_refused(spec: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        model_identity(*configs(spec))


def test_context_parallelism_is_refused() -> None:
    with pytest.raises(ConfigError, match="decode_context_parallel_size=2"):
        model_identity(*configs(tp=2, decode_context_parallel_size=2))


def test_every_tier_maps_to_a_hit_source_of_vllm() -> None:
    assert hit_sources({"host": 256, "disk": 128, "remote": 384}) == {
        CacheHitSource.HOST: 256, CacheHitSource.DISK: 128, CacheHitSource.EXTERNAL_UNSPECIFIED: 384}
    assert hit_sources({"host": 0}) == {}


def test_vllm_keeps_its_hybrid_kv_cache_manager_on_with_the_connector() -> None:
    """vLLM's config turns the hybrid KV cache manager off for a connector its factory does not
    find SupportsHMA in (then a sliding-window layer runs as full attention)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    config = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
                              kv_role="kv_both")
    assert KVConnectorFactory.supports_hma_config(config)


def test_full_cuda_graphs_are_turned_piecewise() -> None:
    """Loads and saves run in wait_for_layer_load / save_kv_layer, which a full CUDA graph's
    replay skips; vLLM asks the connector class before it picks the graph mode."""
    assert KVStoreConnector.requires_piecewise_for_cudagraph({}) is True
    assert KVStoreConnector.requires_piecewise_for_cudagraph({"store_url": "unix:///s"}) is True


def guarded_store(layout: Any, request: pytest.FixtureRequest) -> Any:
    """An embedded GuardedStore of this test's own (the model id is the test's name: embedded
    stores are shared by model id, and a test that failed must not hand its blocks to the next),
    closed when the test ends, passed or not."""
    from kvstore.integrations.vllm.backend import GuardedStore
    from kvstore.integrations.vllm.settings import ConnectorSettings

    store = GuardedStore(ConnectorSettings.from_extra_config({"host_bytes": "1MiB"}), layout, request.node.name)
    request.addfinalizer(store.close)
    return store


def test_a_save_buffer_is_reused_only_once_its_put_has_copied_it(request: pytest.FixtureRequest) -> None:
    """Saves gather into warm staging buffers: one still being put is never handed to the next
    step's save, and each request's blocks reach the store as vLLM held them."""
    import threading

    from kvstore import KVLayout
    from kvstore.integrations.vllm import flush
    from kvstore.integrations.vllm.metadata import KVStoreMetadata, SaveSpec
    from kvstore.integrations.vllm.worker import WorkerSide

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=8, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    kv = {name: torch.randn((10, 2, 8, 8), generator=gen) for name in LAYERS}  # like the CPU backend
    store = guarded_store(layout, request)
    worker = WorkerSide(store, [LAYERS], 2 * 8 * 2 * 4 * 4)
    worker.register_kv_caches(kv)
    first_put_may_run = threading.Event()
    held_back: list[str] = []
    real_try_put = store.try_put

    def try_put(keys: Any, blocks: torch.Tensor, group: int | None = None) -> bool:  # the worker's way in
        if keys == saved["a"][0]:  # the first save's put is still copying when the second gathers
            held_back.append("a")
            assert first_put_may_run.wait(10)
        return real_try_put(keys, blocks, group)

    store.try_put = try_put  # type: ignore[method-assign]
    saved: dict[str, tuple[list[bytes], list[int]]] = {}
    buffers: dict[str, int] = {}
    for step, (req, block_ids) in enumerate((("a", [4, 1, 7]), ("b", [2, 9, 0]), ("c", [3, 5, 8]))):
        if req == "c":  # both puts done: c takes one of their buffers back
            first_put_may_run.set()
            assert flush(10)
        keys = store.block_keys(list(range(100 * step, 100 * step + 24)), "")
        saved[req] = (keys, block_ids)
        meta = KVStoreMetadata(saves=[SaveSpec(req, keys, block_ids)], step=step)
        for layer in LAYERS:
            worker.save_kv_layer(layer, meta)
        buffers[req] = worker._saves[0].buffer.data_ptr()
        worker.wait_for_save()
    assert flush(10)
    assert held_back == ["a"], "the first save's put was not the one held back"
    assert buffers["b"] != buffers["a"], "a buffer still being put was handed to the next save"
    assert buffers["c"] in (buffers["a"], buffers["b"]), "a buffer whose put is done was not reused"
    for keys, block_ids in saved.values():
        out = torch.empty((3, *layout.block_shape))
        assert store.fetch(keys, out).result(10).num_blocks == 3
        for i, block in enumerate(block_ids):
            parts = out[i].reshape(2, -1)
            for layer, name in enumerate(LAYERS):
                assert torch.equal(parts[layer], kv[name][block].flatten())
    worker.shutdown()


def test_a_load_buffer_is_reused_only_once_its_fetch_and_the_step_are_done(request: pytest.FixtureRequest) -> None:
    """A synchronous load's staging buffer goes back to the warm pool at ``wait_for_save``, after
    its fetch is settled: while the fetch may still write it, no save of the step gets it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from kvstore import KVLayout
    from kvstore.integrations.vllm import flush
    from kvstore.integrations.vllm.metadata import KVStoreMetadata, LoadSpec, SaveSpec
    from kvstore.integrations.vllm.worker import WorkerSide
    from kvstore.results import FetchHandle

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=8, dtype=torch.float32)
    gen = torch.Generator().manual_seed(4)
    kv = {name: torch.randn((10, 2, 8, 8), generator=gen) for name in LAYERS}
    store = guarded_store(layout, request)
    stored_keys = store.block_keys(list(range(24)), "")
    stored = torch.randn((3, *layout.block_shape), generator=gen)
    assert store.try_put(stored_keys, stored)
    worker = WorkerSide(store, [LAYERS], 2 * 8 * 2 * 4 * 4)
    worker.register_kv_caches(kv)
    fetch_may_run = threading.Event()
    slow = ThreadPoolExecutor(1)
    real_fetch = store.fetch

    def fetch(keys: Any, into: torch.Tensor) -> FetchHandle:
        def run() -> Any:
            assert fetch_may_run.wait(10)
            return real_fetch(keys, into).result(10)
        return FetchHandle(slow.submit(run), len(keys))

    store.fetch = fetch  # type: ignore[method-assign]
    save_keys = store.block_keys(list(range(500, 524)), "")
    meta = KVStoreMetadata(loads=[LoadSpec("load", stored_keys, [6, 2, 8], is_async=False)],
                           saves=[SaveSpec("save", save_keys, [1, 3, 5])], step=0)
    worker.start_load_kv(meta)
    load_buffer = worker._loads[0].buffer.data_ptr()
    worker.save_kv_layer(LAYERS[0], meta)  # the fetch is still pending: the save takes another buffer
    save_buffer = worker._saves[0].buffer.data_ptr()
    assert save_buffer != load_buffer
    fetch_may_run.set()
    for layer in LAYERS:
        worker.wait_for_layer_load(layer)
        if layer != LAYERS[0]:
            worker.save_kv_layer(layer, meta)
    worker.wait_for_save()
    assert flush(10)
    for i, block in enumerate((6, 2, 8)):  # the load landed in vLLM's blocks
        parts = stored[i].reshape(2, -1)
        for layer, name in enumerate(LAYERS):
            assert torch.equal(kv[name][block].flatten(), parts[layer])
    # both buffers are back, warm, for the next step's loads and saves
    assert worker.paged is not None
    assert {worker.paged.take_staging(3).data_ptr() for _ in range(2)} == {load_buffer, save_buffer}
    worker.shutdown()
    slow.shutdown()


def test_a_specs_entries_run_group_by_group() -> None:
    from kvstore.integrations.vllm.metadata import group_runs

    assert group_runs((), 3) == [(0, slice(0, 3))] and group_runs((), 0) == []  # one group: every entry
    assert group_runs((0, 0, 1, 5, 5, 5), 6) == [(0, slice(0, 2)), (1, slice(2, 3)), (5, slice(3, 6))]
    with pytest.raises(AssertionError, match="2 groups for 3 entries"):
        group_runs((0, 1), 3)
