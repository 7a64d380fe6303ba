"""engine: a small paged-attention inference engine for Llama-family models, kvstore's first user.

    import torch
    from kvstore.engine import LLMEngine, SamplingParams
    llm = LLMEngine(model="path/to/hf-dir", device="cpu", dtype=torch.float32)
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0.0))

See docs/engine.md.
"""

from __future__ import annotations

from kvstore.engine.checkpoint import CheckpointError
from kvstore.engine.config import EngineConfig
from kvstore.engine.llm import LLMEngine
from kvstore.engine.sampling import SamplingParams
from kvstore.engine.sequence import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["CheckpointError", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestMetrics", "RequestOutput",
           "SamplingParams"]
