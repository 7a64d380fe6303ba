"""The namespace of a vLLM model in kvstore: model identity + KV layout, from vLLM's configs.

Both connector roles derive the same (model id, KVLayout) from ``vllm_config`` and the
``kv_cache_config`` vLLM hands every connector, so the scheduler's keys name the blocks the
worker moves. A kvstore block is one vLLM block of every layer of a KV cache group, layer
after layer, each layer's part copied as vLLM's opaque bytes: the KVLayout below has exactly
that many bytes, and the model id names vLLM's layout so that nothing else ever shares its keys.

A model of one full-attention group (every layer) keeps the layout and keys it always had. A
hybrid model (vLLM's hybrid KV cache manager on: full-attention and sliding-window groups, as
Gemma 3's) maps each vLLM KV cache group g to kvstore's KV group g (kvstore/layout.py), its
layers in the group's slots in vLLM's order; vLLM gives every group as many layers (padding the
last of a kind), so every group's block has one shape.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore.errors import ConfigError
from kvstore.layout import DTYPE_NAMES, FULL, SLIDING, KVGroup, KVLayout

_GEOMETRY = ("block_size", "num_kv_heads", "head_size", "dtype", "page_size_bytes")


@dataclass(frozen=True)
class ModelIdentity:
    """What makes two vLLM caches' blocks interchangeable.

    Attributes:
        model_id: checkpoint (name or resolved path, with a digest of a local config.json),
            revision, vLLM's KV spec(s) and head size, and the pipeline stage; the namespace's
            model id.
        layout: a kvstore layout of exactly one vLLM block of every layer of a group.
        group_layers: per KV group (vLLM's group index), its attention layers in the order
            their bytes sit in a block (its slots).
        layer_bytes: bytes of one vLLM block of one layer.
    """

    model_id: str
    layout: KVLayout
    group_layers: tuple[tuple[str, ...], ...]
    layer_bytes: int

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Every attention layer, group after group."""
        return tuple(name for names in self.group_layers for name in names)


def model_identity(vllm_config: Any, kv_cache_config: Any, override: str | None = None) -> ModelIdentity:
    """Derive the identity; ConfigError for models kvstore cannot hold (a KV cache group of
    anything but full attention or a sliding window, groups of different block geometry, a KV
    dtype kvstore does not know, context parallelism)."""
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise ConfigError("vLLM's KV cache config has no KV cache groups (a model without attention KV)")
    specs = [group.kv_cache_spec for group in groups]
    kinds = [_group_kind(spec, g, len(groups)) for g, spec in enumerate(specs)]
    spec = specs[0]
    for attr in _GEOMETRY:
        if not hasattr(spec, attr):
            raise ConfigError(f"KV cache spec {type(spec).__name__} is not attention KV (no {attr})")
    for g, other in enumerate(specs[1:], 1):
        differs = [a for a in _GEOMETRY if getattr(other, a, None) != getattr(spec, a)]
        if differs:
            raise ConfigError(f"KV cache group {g} ({type(other).__name__}) differs from group 0 in "
                              + ", ".join(f"{a} {getattr(other, a, None)} vs {getattr(spec, a)}" for a in differs)
                              + ": kvstore keeps one block shape for every group")
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
    group_layers = tuple(tuple(group.layer_names) for group in groups)
    if len(groups) == 1 and kinds[0] == (FULL, None):  # today's layout: its keys stay valid
        kv_groups: tuple[KVGroup, ...] = ()
    else:
        index = _layer_indices([name for names in group_layers for name in names])
        kv_groups = tuple(KVGroup(kind, tuple(index[name] for name in names), window)
                          for (kind, window), names in zip(kinds, group_layers, strict=True))
    layout = KVLayout(num_layers=max(len(names) for names in group_layers), num_kv_heads=heads, head_dim=head_dim,
                      block_size=block_size, dtype=dtype, tp_rank=tp_rank,
                      tp_size=int(parallel.tensor_parallel_size), groups=kv_groups)
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
    spec_names = "+".join(dict.fromkeys(type(s).__name__ for s in specs))
    model_id = f"vllm:{name}@{model.revision or '-'}:{spec_names}:head{head_size}:{stage}"
    return ModelIdentity(model_id, layout, group_layers, layer_bytes)


def _group_kind(spec: Any, g: int, num_groups: int) -> tuple[str, int | None]:
    """(kvstore group kind, window) of vLLM's spec, by name (no vLLM import here); a one-line
    ConfigError naming the kind for any other.

    A chunked-local, MLA, Mamba or linear-attention (vLLM keeps its recurrent state in a
    MambaSpec) group keeps other bytes per block than the K and V of every token the key names.
    A FullAttentionSpec with a window is a sliding-window layer vLLM runs as full attention
    (its hybrid KV cache manager off): its KV of the tokens below the window is never written. A
    non-causal (prefix-LM) block's KV depends on later tokens, which its prefix key does not name.
    """
    kind = type(spec).__name__
    where = f" (KV cache group {g} of {num_groups})" if num_groups > 1 else ""
    if "MLA" in kind:
        raise ConfigError(f"the kvstore connector does not support MLA models: KV cache spec {kind}{where}")
    if "Mamba" in kind:
        raise ConfigError(f"the kvstore connector does not support Mamba or linear-attention state: KV cache spec "
                          f"{kind}{where}")
    if getattr(spec, "non_causal", False):
        raise ConfigError(f"the kvstore connector does not support non-causal (prefix-LM) attention: a block's KV "
                          f"depends on the tokens after it{where}")
    if kind == "SlidingWindowSpec":
        extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        if extra:
            raise ConfigError(f"the kvstore connector does not support sliding-window groups that retain "
                              f"{extra} tokens below the window (multi-token-prediction drafts){where}")
        return SLIDING, int(spec.sliding_window)
    window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
    if kind != "FullAttentionSpec" or window is not None:
        detail = f", window {window}" if window is not None else ""
        hint = (" (vLLM runs sliding-window layers as full attention when its hybrid KV cache manager is off: "
                "leave it on)") if kind == "FullAttentionSpec" else ""
        raise ConfigError(f"the kvstore connector supports full-attention and sliding-window KV cache groups, this "
                          f"model's KV cache spec is {kind}{detail}{where}{hint}")
    return FULL, None


def _layer_indices(names: list[str]) -> dict[str, int]:
    """Each layer's index in the model: the one number in its name (vLLM's rule), else its place
    in ``names``."""
    numbers = [re.findall(r"\d+", name) for name in names]
    if all(len(n) == 1 for n in numbers) and len({n[0] for n in numbers}) == len(names):
        return {name: int(n[0]) for name, n in zip(names, numbers, strict=True)}
    return {name: i for i, name in enumerate(names)}


def _ranks(parallel: Any) -> tuple[int, int]:
    """This worker's (tensor-parallel, pipeline-parallel) rank; vLLM orders a worker's ``rank``
    as PP x PCP x TP (PCP refused above). The scheduler, rank 0's view, asks only for keys."""
    tp_size, pp_size = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    rank = int(getattr(parallel, "rank", 0))
    return rank % tp_size, (rank // tp_size) % pp_size
