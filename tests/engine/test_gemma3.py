"""Gemma 3 (``gemma3_text``): each way transformers' Gemma 3 differs from its Llama is in the
engine, and the parity fixture sees each one: with the engine's model stripped of any one of them
(the embedding's sqrt(hidden_size), RMSNorm's ``1 + w``, the q/k norms, the norms after attention
and after the MLP, the norm before the MLP being its own, GeGLU's gelu-tanh, the attention scale
``query_pre_attn_scalar ** -0.5``, the sliding layers' RoPE base, the sliding window itself, the
final logit softcapping) the prompt logits leave transformers' by far more than the tolerance.
Also: config.json in transformers 4.x and 5.x form, the layer pattern Gemma 3 assumes without
``layer_types``, the embedding scale in the model dtype, tied embeddings."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.engine import LLMEngine, SamplingParams
from kvstore.engine.checkpoint import AttentionSpec, ModelConfig, load_checkpoint
from kvstore.engine.layers import ACTIVATIONS, RMSNorm
from tests.engine.conftest import SLIDING_PROMPTS, gemma3, make_engine

WITH_LOGITS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logits=True)
PROMPT = SLIDING_PROMPTS[2]  # 40 tokens, five windows of 8


def hf_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def engine_logits(path: Path, strip: Callable[[LLMEngine], None] | None = None) -> torch.Tensor:
    with make_engine(path) as llm:
        if strip is not None:
            strip(llm)
        out = llm.generate([PROMPT], WITH_LOGITS)[0]
    assert out.prompt_logits is not None
    return out.prompt_logits


def no_offset(norm: RMSNorm) -> None:
    norm.weight = norm.weight - 1.0  # w, as a Llama RMSNorm would scale by


def strip_each_layer(change: Callable[[Any], None]) -> Callable[[LLMEngine], None]:
    def strip(llm: LLMEngine) -> None:
        for layer in llm.model.layers:
            change(layer)
    return strip


def full_attention(llm: LLMEngine) -> None:
    for layer in llm.model.layers:
        layer.spec = AttentionSpec()
    llm.model.windows = (None,)


def one_rope(llm: LLMEngine) -> None:
    full = llm.model.ropes[2]  # layer 2 is a full layer
    llm.model.ropes = [full] * len(llm.model.ropes)


DIFFERENCES: dict[str, Callable[[LLMEngine], None]] = {
    "embedding scaled by sqrt(hidden_size)": lambda llm: setattr(llm.model, "embed_scale", None),
    "RMSNorm scales by 1 + w": lambda llm: [no_offset(n) for layer in llm.model.layers for n in
                                            (layer.attn_norm, layer.mlp_norm, layer.attn_out_norm,
                                             layer.mlp_out_norm, layer.qk_norm)] and None,
    "q and k normed per head": strip_each_layer(lambda layer: setattr(layer, "qk_norm", None)),
    "a norm after attention": strip_each_layer(lambda layer: setattr(layer, "attn_out_norm", None)),
    "a norm after the MLP": strip_each_layer(lambda layer: setattr(layer, "mlp_out_norm", None)),
    "the norm before the MLP is its own": strip_each_layer(lambda layer: setattr(layer, "mlp_norm", layer.attn_norm)),
    "GeGLU (gelu, tanh approximation)": strip_each_layer(lambda layer: setattr(layer, "act", ACTIVATIONS["silu"])),
    "attention scale query_pre_attn_scalar ** -0.5": lambda llm: setattr(llm.model, "scale", 16 ** -0.5),
    "sliding layers' own RoPE base": one_rope,
    "the sliding window": full_attention,
}


def test_the_engine_matches_and_each_difference_from_llama_matters(hf_gemma3: tuple[Any, Path]) -> None:
    model, path = hf_gemma3
    ckpt = load_checkpoint(path)
    assert "lm_head.weight" not in ckpt.weights and ckpt.config.tie_word_embeddings  # tied: the head is the embedding
    want = hf_logits(model, PROMPT)
    torch.testing.assert_close(engine_logits(path), want, atol=1e-4, rtol=1e-4)
    for name, strip in DIFFERENCES.items():
        gap = float((engine_logits(path, strip) - want).abs().max())
        assert gap > 0.05, f"without '{name}' the logits stay within {gap:.2g} of transformers'"


def test_final_logit_softcapping(tmp_path: Path) -> None:
    model, path = gemma3(tmp_path, final_logit_softcapping=10.0)
    assert load_checkpoint(path).config.final_logit_softcapping == 10.0
    want = hf_logits(model, PROMPT)
    assert float(want.abs().max()) <= 10.0  # capped
    torch.testing.assert_close(engine_logits(path), want, atol=1e-4, rtol=1e-4)

    def uncapped(llm: LLMEngine) -> None:
        llm.model.config = ModelConfig(**{**llm.model.config.__dict__, "final_logit_softcapping": None})

    assert float((engine_logits(path, uncapped) - want).abs().max()) > 0.05


def test_the_embedding_scale_is_held_in_the_model_dtype(hf_gemma3: tuple[Any, Path]) -> None:
    _, path = hf_gemma3
    for dtype, scale in ((torch.float32, math.sqrt(64)), (torch.bfloat16, 8.0)):
        with make_engine(path, dtype=dtype, kv_cache_bytes=64 * 1024) as llm:
            assert llm.model.embed_scale is not None and llm.model.embed_scale.dtype == dtype
            assert float(llm.model.embed_scale) == scale
    # what transformers does for hidden 640 (Gemma-3-270M): 25.298... rounds to 25.25 in bfloat16
    from kvstore.engine.families import embed_scale

    c = ModelConfig(model_type="gemma3_text", hidden_size=640, num_heads=4, num_kv_heads=1, head_dim=256)
    assert float(embed_scale(c, torch.bfloat16)) == 25.25 and float(embed_scale(c, torch.float32)) == pytest.approx(
        math.sqrt(640))


def test_bfloat16_runs_close_to_float32(hf_gemma3: tuple[Any, Path]) -> None:
    _, path = hf_gemma3
    base = engine_logits(path)
    with make_engine(path, dtype=torch.bfloat16, kv_cache_bytes=64 * 1024) as llm:
        out = llm.generate([PROMPT], WITH_LOGITS)[0]
    assert out.prompt_logits is not None
    torch.testing.assert_close(out.prompt_logits, base, atol=0.5, rtol=0.1)


GEMMA = {"model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16}


def test_config_json_of_transformers_4_and_5() -> None:
    # 5.x: rope_parameters per layer kind, layer_types written out
    five = ModelConfig.from_hf({**GEMMA, "num_hidden_layers": 3, "sliding_window": 512,
                                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                       "rope_theta": 1e6},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 1e4}}})
    assert [s.window for s in five.layer_specs] == [512, None, 512]
    assert (five.rope_theta, five.sliding_rope_theta, five.sliding_rope_scaling) == (1e6, 1e4, None)
    assert five.rope_scaling is not None and five.rope_scaling["factor"] == 8.0
    assert five.query_pre_attn_scalar == 256 and five.tie_word_embeddings and five.hidden_act == "gelu_pytorch_tanh"
    # 4.x: rope_theta, rope_local_base_freq, rope_scaling (the full layers'), no layer_types
    four = ModelConfig.from_hf({**GEMMA, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window": 512,
                                "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 168})
    assert (four.rope_theta, four.sliding_rope_theta, four.query_pre_attn_scalar) == (1e6, 1e4, 168)
    assert four.rope_scaling == {"rope_type": "linear", "factor": 8.0} and four.sliding_rope_scaling is None
    # without layer_types, every 6th layer is full: 5, 11, 17 of 18 (transformers' and llama.cpp's rule)
    assert [i for i, s in enumerate(four.layer_specs) if s.window is None] == [5, 11, 17]
    assert {s.window for s in four.layer_specs} == {512, None}
