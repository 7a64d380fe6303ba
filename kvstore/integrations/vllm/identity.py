"""The namespace of a vLLM model in kvstore: model identity + KV layout, from vLLM's configs.

Both connector roles derive the same (model id, KVLayout) from ``vllm_config`` and the
``kv_cache_config`` vLLM hands every connector, so the scheduler's keys name the blocks the
worker moves. A kvstore block is one vLLM block of every layer, layer after layer, each
layer's part copied as vLLM's opaque bytes: the KVLayout below has exactly that many bytes,
and the model id names vLLM's layout so that nothing else ever shares its keys.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore.errors import ConfigError
from kvstore.layout import DTYPE_NAMES, KVLayout


@dataclass(frozen=True)
class ModelIdentity:
    """What makes two vLLM caches' blocks interchangeable.

    Attributes:
        model_id: checkpoint (name or resolved path, with a digest of a local config.json),
            revision, vLLM's KV dtype and block geometry; the namespace's model id.
        layout: a kvstore layout of exactly one vLLM block of every layer.
        layer_names: vLLM's attention layers, in the order their bytes sit in a block.
        layer_bytes: bytes of one vLLM block of one layer.
    """

    model_id: str
    layout: KVLayout
    layer_names: tuple[str, ...]
    layer_bytes: int


def model_identity(vllm_config: Any, kv_cache_config: Any, override: str | None = None) -> ModelIdentity:
    """Derive the identity; ConfigError for models kvstore cannot hold (several KV cache groups,
    non-attention state, a KV dtype kvstore does not know)."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise ConfigError(f"the kvstore connector supports one KV cache group, this model has {len(groups)} "
                          "(sliding-window or hybrid models are not supported)")
    spec = groups[0].kv_cache_spec
    for attr in ("block_size", "num_kv_heads", "head_size", "dtype", "page_size_bytes"):
        if not hasattr(spec, attr):
            raise ConfigError(f"KV cache spec {type(spec).__name__} is not attention KV (no {attr})")
    dtype: torch.dtype = spec.dtype
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"KV cache dtype {dtype} is not one of {sorted(DTYPE_NAMES.values())}")
    block_size, heads, head_size = int(spec.block_size), int(spec.num_kv_heads), int(spec.head_size)
    layer_bytes = int(spec.page_size_bytes)
    per_token_head = 2 * block_size * heads * dtype.itemsize
    if layer_bytes % per_token_head:
        raise ConfigError(f"a vLLM block of one layer is {layer_bytes} bytes, not a multiple of "
                          f"2 x {block_size} tokens x {heads} heads x {dtype.itemsize} bytes")
    head_dim = layer_bytes // per_token_head  # head_size, or more where the backend pads
    parallel = vllm_config.parallel_config
    layout = KVLayout(num_layers=len(groups[0].layer_names), num_kv_heads=heads, head_dim=head_dim,
                      block_size=block_size, dtype=dtype, tp_rank=_tp_rank(parallel),
                      tp_size=int(parallel.tensor_parallel_size))
    model = vllm_config.model_config
    if override:
        name = override
    else:
        name = str(model.model)
        config_json = Path(name) / "config.json"
        if config_json.is_file():  # a local checkpoint: its path and its config's digest
            name = f"{Path(name).resolve()}#{hashlib.sha256(config_json.read_bytes()).hexdigest()[:16]}"
    model_id = (f"vllm:{name}@{model.revision or '-'}:{type(spec).__name__}:head{head_size}"
                f":pp{int(parallel.pipeline_parallel_size)}")
    return ModelIdentity(model_id, layout, tuple(groups[0].layer_names), layer_bytes)


def _tp_rank(parallel: Any) -> int:
    """This worker's tensor-parallel rank (the scheduler, rank 0's view, asks only for keys)."""
    size = int(parallel.tensor_parallel_size)
    return int(getattr(parallel, "rank", 0)) % size if size > 1 else 0
