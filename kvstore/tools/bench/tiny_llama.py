"""A random Llama checkpoint directory vLLM (or transformers) can load, made without a hub.

Weights come from ``kvstore.engine.checkpoint.random_checkpoint`` (seeded), the tokenizer is word-level:
the text ``"t0 t17 t5"`` is the token ids ``[0, 17, 5]``, so prompts can be written as text
or as ids and mean the same thing. Used by the vLLM tests, ``kvstore bench vllm`` and the
``vllm serve`` example in docs/vllm.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvstore.engine.checkpoint import random_checkpoint, save_random_checkpoint

# Small enough that a vLLM start and a 1,000-token prefill take a fraction of a second.
TEST_MODEL: dict[str, Any] = dict(num_layers=2, hidden_size=128, intermediate_size=256, num_heads=4,
                                  num_kv_heads=2, head_dim=32, vocab_size=1000, max_position_embeddings=4096)
EOS_ID = 1


def text_of(token_ids: list[int]) -> str:
    """The prompt text that tokenizes to ``token_ids`` with the word-level tokenizer."""
    return " ".join(f"t{i}" for i in token_ids)


def save_tiny_llama(path: str | os.PathLike[str], model: dict[str, Any] | None = None, seed: int = 0) -> Path:
    """Write ``config.json``, ``model.safetensors``, ``tokenizer.json`` and its configs to ``path``.

    Args:
        path: the directory (created).
        model: ModelConfig overrides (default TEST_MODEL).
        seed: the weights' seed; the same seed gives the same bytes.

    Returns:
        ``path`` as a Path.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    spec = dict(TEST_MODEL if model is None else model)
    root = Path(path)
    save_random_checkpoint(root, random_checkpoint(spec, seed))
    vocab = {f"t{i}": i for i in range(int(spec["vocab_size"]))}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "eos_token": f"t{EOS_ID}",
        "bos_token": None, "model_max_length": int(spec["max_position_embeddings"]),
    }, indent=2))
    (root / "special_tokens_map.json").write_text(json.dumps({"unk_token": "t0", "eos_token": f"t{EOS_ID}"}))
    cfg = json.loads((root / "config.json").read_text())
    cfg.update(eos_token_id=EOS_ID, bos_token_id=None)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}))
    return root
