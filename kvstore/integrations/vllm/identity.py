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
            revision, vLLM's KV spec and head size, and the pipeline stage; the namespace's
            model id.
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
    anything but plain full attention, a KV dtype kvstore does not know, context parallelism)."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise ConfigError(f"the kvstore connector supports one KV cache group, this model has {len(groups)} "
                          "(sliding-window or hybrid models are not supported)")
    spec = groups[0].kv_cache_spec
    _check_full_attention(spec)
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
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if int(getattr(parallel, name, 1)) > 1:  # a block's tokens spread over ranks: not vLLM's block
            raise ConfigError(f"the kvstore connector does not support context parallelism ({name}="
                              f"{getattr(parallel, name)})")
    tp_rank, pp_rank = _ranks(parallel)
    layout = KVLayout(num_layers=len(groups[0].layer_names), num_kv_heads=heads, head_dim=head_dim,
                      block_size=block_size, dtype=dtype, tp_rank=tp_rank,
                      tp_size=int(parallel.tensor_parallel_size))
    model = vllm_config.model_config
    if override:
        name = override
    else:
        name = str(model.model)
        config_json = Path(name) / "config.json"
        if config_json.is_file():  # a local checkpoint: its path and its config's digest
            name = f"{Path(name).resolve()}#{hashlib.sha256(config_json.read_bytes()).hexdigest()[:16]}"
    # Each pipeline stage holds other layers under the same keys: its own namespace. (One stage
    # keeps the "pp1" it had before stages were named, so its stored blocks stay valid.)
    pp_size = int(parallel.pipeline_parallel_size)
    stage = f"pp{pp_rank}of{pp_size}" if pp_size > 1 else "pp1"
    model_id = f"vllm:{name}@{model.revision or '-'}:{type(spec).__name__}:head{head_size}:{stage}"
    return ModelIdentity(model_id, layout, tuple(groups[0].layer_names), layer_bytes)


def _check_full_attention(spec: Any) -> None:
    """ConfigError unless vLLM's spec is plain full attention (by name: no vLLM import here).

    A sliding-window, chunked-local or MLA layer keeps other bytes per block than the K and V
    of every token (vLLM without its hybrid allocator, as with a connector, hands a model mixing
    such layers with full ones over as full attention with the window set). A non-causal
    (prefix-LM) block's KV depends on later tokens, which its prefix key does not name.
    """
    kind = type(spec).__name__
    if "MLA" in kind:
        raise ConfigError(f"the kvstore connector does not support MLA models (KV cache spec {kind})")
    window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
    if kind != "FullAttentionSpec" or window is not None:
        detail = f", window {window}" if window is not None else ""
        raise ConfigError(f"the kvstore connector supports plain full attention only, this model's KV cache "
                          f"spec is {kind}{detail} (sliding-window, chunked-local and MLA models are not supported)")
    if getattr(spec, "non_causal", False):
        raise ConfigError("the kvstore connector does not support non-causal (prefix-LM) attention: a block's KV "
                          "depends on the tokens after it")


def _ranks(parallel: Any) -> tuple[int, int]:
    """This worker's (tensor-parallel, pipeline-parallel) rank; vLLM orders a worker's ``rank``
    as PP x PCP x TP (PCP refused above). The scheduler, rank 0's view, asks only for keys."""
    tp_size, pp_size = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    rank = int(getattr(parallel, "rank", 0))
    return rank % tp_size, (rank // tp_size) % pp_size
