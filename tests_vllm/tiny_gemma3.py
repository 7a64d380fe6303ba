"""A random Gemma 3 checkpoint directory (transformers' Gemma3ForCausalLM) that vLLM runs as a
hybrid model: five sliding-window layers (WINDOW tokens) to one full-attention layer, so vLLM's
hybrid KV cache manager makes six KV cache groups (five sliding, one full) of one layer each.

The tokenizer is tiny_llama's word-level one (``"t0 t17 t5"`` is ``[0, 17, 5]``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

WINDOW = 48  # tokens; at vLLM's CPU block of 32 tokens a hit needs cdiv(47, 32) = 2 blocks of each sliding group
LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]
VOCAB = 1000


def save_tiny_gemma3(path: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write ``config.json``, ``model.safetensors`` and a word-level tokenizer to ``path``."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    # wider than Gemma's 0.02: logits that depend on the prompt more
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=WINDOW,
                              layer_types=LAYER_TYPES, max_position_embeddings=4096, initializer_range=0.05,
                              bos_token_id=None, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(seed)
    Gemma3ForCausalLM(config).to(torch.float32).save_pretrained(root)
    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "eos_token": "t1", "bos_token": None,
        "model_max_length": 4096}))
    return root
