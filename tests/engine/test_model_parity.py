"""Greedy output and prompt logits equal Hugging Face transformers' (fp32, eager attention).

Tolerance: prompt logits within atol 1e-4 / rtol 1e-4 (fp32; the engine fuses q/k/v and
gate/up projections and attends through the paged reference kernels, so sums differ in order),
with the weights prepacked for oneDNN (the default on the CPU) and without, decode attention
through the CPU kernel that reads the pool in place (the default) and through torch's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.engine import SamplingParams
from kvstore.engine.checkpoint import load_checkpoint
from kvstore.kernels import cpu_rows
from tests.engine.conftest import PROMPTS, hf_greedy_check, make_engine
from tests.factories import require

WITH_LOGITS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logits=True)


def check_parity(hf: tuple[Any, Path], **engine_kwargs: Any) -> None:
    model, path = hf
    llm = make_engine(path, **engine_kwargs)
    try:
        if engine_kwargs.get("prepack_weights"):  # oneDNN's blocked weights really serve the products
            assert llm.model.prepacked and llm.model.layers[0].qkv.packed is not None
            assert llm.model.lm_head is not None and llm.model.lm_head.packed is not None
        if "cpu_decode_kernel" in engine_kwargs:  # decode attention really takes the path asked for
            require(not engine_kwargs["cpu_decode_kernel"] or cpu_rows.load(), "the CPU decode kernel did not build")
            assert llm.runner.row_kernel == engine_kwargs["cpu_decode_kernel"]
        outs = llm.generate(PROMPTS, WITH_LOGITS)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert len(out.token_ids) == 5
            hf_logits = hf_greedy_check(model, prompt, out.token_ids)
            assert out.prompt_logits is not None and out.prompt_logits.shape == hf_logits.shape
            torch.testing.assert_close(out.prompt_logits, hf_logits, atol=1e-4, rtol=1e-4)
        llm.check_integrity()
    finally:
        llm.close()


# (prepacked weights, the CPU decode kernel): the default, then each without
VARIANTS = pytest.mark.parametrize("prepack,row_kernel", [(True, True), (False, True), (True, False)],
                                   ids=["prepacked-row-kernel", "plain-row-kernel", "prepacked-torch-attention"])


@VARIANTS
def test_llama_llama3_rope_matches_transformers(hf_llama: tuple[Any, Path], prepack: bool, row_kernel: bool) -> None:
    check_parity(hf_llama, prepack_weights=prepack, cpu_decode_kernel=row_kernel)


@VARIANTS
def test_qwen2_bias_and_tied_embeddings_match_transformers(hf_qwen2: tuple[Any, Path], prepack: bool,
                                                           row_kernel: bool) -> None:
    assert "lm_head.weight" not in load_checkpoint(hf_qwen2[1]).weights  # really tied
    check_parity(hf_qwen2, prepack_weights=prepack, cpu_decode_kernel=row_kernel)


def test_sharded_checkpoint_and_chunked_prefill(hf_llama: tuple[Any, Path], tmp_path: Path) -> None:
    model, _ = hf_llama
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    # a 7-token budget cuts every longer prompt into chunks, interleaved with decodes
    check_parity((model, tmp_path), max_num_batched_tokens=7)


def test_mistral_without_sliding_window(tmp_path: Path) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(2)
    model = MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=16, sliding_window=None)).eval()
    model.save_pretrained(tmp_path)
    check_parity((model, tmp_path))


def test_greedy_decode_is_batch_invariant_and_stops_at_eos(hf_llama: tuple[Any, Path]) -> None:
    """Alone or in a batch, the same tokens; without ignore_eos the EOS from generation_config ends it."""
    _model, path = hf_llama
    llm = make_engine(path)
    try:
        alone = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
        batch = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        assert batch[2].token_ids == alone.token_ids
        eos = alone.token_ids[2]
        cfg = json.loads((path / "generation_config.json").read_text())
        stopped = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(eos,)))[0]
        assert stopped.token_ids == alone.token_ids[:3] and stopped.outputs[0].finish_reason == "stop"
        assert cfg["eos_token_id"] == 2
    finally:
        llm.close()


def test_fp16_and_bf16_run_close_to_fp32(hf_llama: tuple[Any, Path]) -> None:
    _, path = hf_llama
    ref = make_engine(path)
    base = ref.generate(PROMPTS[2], WITH_LOGITS)[0].prompt_logits
    ref.close()
    for dtype in (torch.float16, torch.bfloat16):
        llm = make_engine(path, dtype=dtype, kv_cache_bytes=64 * 1024, host_bytes=64 * 4096)
        out = llm.generate(PROMPTS[2], WITH_LOGITS)[0]
        llm.close()
        assert out.prompt_logits is not None
        torch.testing.assert_close(out.prompt_logits, base, atol=0.15, rtol=0.05)


def test_tokenizer_text_prompts(hf_llama: tuple[Any, Path], tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    _, path = hf_llama
    model_dir = tmp_path / "with-tokenizer"
    shutil.copytree(path, model_dir)
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *[f"w{i}" for i in range(125)]])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model_dir / "tokenizer.json"))
    llm = make_engine(model_dir)
    try:
        out = llm.generate("w1 w2 w3 w4 w5", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
        assert out.prompt_token_ids == [4, 5, 6, 7, 8]
        assert out.text == tok.decode(out.token_ids)
    finally:
        llm.close()
    bare = make_engine(path)
    with pytest.raises(ValueError, match="tokenizer"):
        bare.generate("w1 w2")
    bare.close()
