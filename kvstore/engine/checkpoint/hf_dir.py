"""A Hugging Face checkpoint directory read into a ``Checkpoint``: config.json (and
generation_config.json) into a ``ModelConfig``, the safetensors weights (one file, or shards named
by model.safetensors.index.json) into CPU tensors in the file's dtype, and tokenizer.json.

The GGUF path ends here too: a GGUF file is read through its converted copy, which is such a
directory (``kvstore.engine.checkpoint.model_cache``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from kvstore.engine.checkpoint.types import Checkpoint, CheckpointError, ModelConfig, need_tokenizers


def read_config(root: Path) -> ModelConfig:
    """The ``ModelConfig`` of the checkpoint directory ``root`` (its weights are not read).

    Raises:
        CheckpointError: config.json is missing (the message names a .gguf beside it) or malformed.
    """
    if not (root / "config.json").is_file():
        ggufs = sorted(p.name for p in root.glob("*.gguf"))
        hint = f" (it holds {', '.join(ggufs)}: pass the .gguf file itself)" if ggufs else ""
        raise CheckpointError(f"{root} has no config.json{hint}")
    gen_path = root / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else None
    return ModelConfig.from_hf(_read_json(root / "config.json"), generation)


def load_dir(root: Path, model_id: str | None) -> Checkpoint:
    """Read the checkpoint directory ``root``.

    Args:
        root: a Hugging Face checkpoint directory.
        model_id: the id the checkpoint is known by; None names it by the directory and a digest of
            its config and its weight files' first bytes (so different random models differ).

    Raises:
        CheckpointError: config.json, a weight shard or tokenizer.json is missing or malformed.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_config(root)
    digest = hashlib.sha256((root / "config.json").read_bytes())
    weights: dict[str, torch.Tensor] = {}
    for f in _weight_files(root):
        try:
            weights.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read weights {f.name}: {exc}") from None
        with open(f, "rb") as fh:  # header + the first weights: different random models differ here
            digest.update(fh.read(1 << 16))
    tokenizer = None
    if (root / "tokenizer.json").is_file():
        need_tokenizers()
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as exc:  # the tokenizers library raises plain Exception subclasses
            raise CheckpointError(f"cannot read tokenizer.json: {exc}") from None
    return Checkpoint(config, weights, tokenizer, model_id or f"{root.name}:{digest.hexdigest()[:16]}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = [root / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {root}")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"weight shard {f} is missing")
    return files
