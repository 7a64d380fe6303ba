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


@pytest.mark.parametrize(("spec", "match"), [
    (SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16, sliding_window=64),
     "SlidingWindowSpec"),
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


def test_full_cuda_graphs_are_turned_piecewise() -> None:
    """Loads and saves run in wait_for_layer_load / save_kv_layer, which a full CUDA graph's
    replay skips; vLLM asks the connector class before it picks the graph mode."""
    assert KVStoreConnector.requires_piecewise_for_cudagraph({}) is True
    assert KVStoreConnector.requires_piecewise_for_cudagraph({"store": "unix:///s"}) is True
