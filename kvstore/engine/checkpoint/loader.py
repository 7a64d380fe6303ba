"""The dispatcher, at the package's top: a model path (a Hugging Face checkpoint directory or a
GGUF file) to the directory it is read from, its ``ModelConfig``, or its ``Checkpoint``.

Nothing is downloaded: a model is always a local directory or file. A GGUF is read through its
converted copy, a Hugging Face directory in the model cache (``model_cache``); a directory is read
as it is (``hf_dir``). ``path=None`` in ``read_model_config`` is the random model (``random_model``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvstore.engine.checkpoint.hf_dir import load_dir, read_config
from kvstore.engine.checkpoint.model_cache import convert_gguf
from kvstore.engine.checkpoint.random_model import random_config
from kvstore.engine.checkpoint.types import Checkpoint, CheckpointError, ModelConfig


def checkpoint_dir(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The Hugging Face directory a model path is read from: the path itself, or for a GGUF file
    its converted copy (built on the first call; see ``kvstore.engine.checkpoint.model_cache``).

    Raises:
        CheckpointError: a missing path, or a file that is not a readable GGUF of a supported model.
    """
    root = Path(path)
    if root.is_dir():
        return root
    if not root.exists():
        raise CheckpointError(f"model {root} does not exist (a model is a Hugging Face checkpoint "
                              "directory or a .gguf file)")
    return convert_gguf(root, cache_dir).path


def load_checkpoint(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Checkpoint:
    """Read a checkpoint directory, or a GGUF file, into CPU tensors (in the file's dtype; a
    quantized GGUF's tensors dequantized to float32).

    Args:
        path: a Hugging Face checkpoint directory or a .gguf file.
        cache_dir: where GGUF files' converted copies are kept (default
            ``kvstore.engine.checkpoint.model_cache.default_cache_dir()``).

    Raises:
        CheckpointError: the directory, config.json or a weight shard is missing or malformed; a
            file that is not a GGUF, a truncated GGUF, or one of an architecture the engine lacks.
    """
    src = Path(path)
    if src.is_file():
        copy = convert_gguf(src, cache_dir)
        # a GGUF's id names the file and its content, not the cache directory it was copied to
        return load_dir(copy.path, f"{src.stem}:{copy.sha256[:16]}")
    return load_dir(checkpoint_dir(src), None)


def read_model_config(path: str | os.PathLike[str] | None, random_model: dict[str, Any] | None = None) -> ModelConfig:
    """A model's hyperparameters without its weights (sizing a KV pool before loading it): a
    checkpoint directory's or a GGUF's (converting it once, as loading would), or the random
    model's with ``random_model``'s overrides when ``path`` is None.

    Raises:
        CheckpointError: as ``load_checkpoint``.
    """
    if path is None:
        return random_config(random_model)
    return read_config(checkpoint_dir(path))
