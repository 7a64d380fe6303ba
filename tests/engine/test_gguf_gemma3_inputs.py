"""A gemma3 GGUF written here as llama.cpp's converter writes one (its tensor names, every norm
stored as 1 + w, no layer pattern and no query_pre_attn_scalar in the metadata, a sentencepiece
vocabulary whose scores do not rank its merges, spaces spelled as spaces), from a tiny random
Gemma 3: the converted copy has the model's weights back (norms as w), its layer kinds (every 6th
full), window, RoPE bases and scale; the engine runs it as transformers runs the original; the
tokenizer tokenizes as transformers reads the file; the copy gets a Gemma chat template and
<end_of_turn> as a stop token."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.engine import LLMEngine, SamplingParams
from kvstore.engine.checkpoint import convert_gguf, load_checkpoint
from kvstore.engine.checkpoint.gguf_tokenizer import GEMMA3_CHAT_TEMPLATE
from tests.engine.conftest import gemma3, hf_greedy_check

from factories import require

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
# "ab" comes before "bc" in the file but scores lower: Gemma's merges follow the file's order
PIECES = ["▁", "a", "b", "c", "h", "e", "l", "o", "u", "s", "r", "ab", "bc", "he", "ll", "llo", "▁he", "▁hello",
          "us", "er", "▁us", "▁user"]
TOKENS = [*SPECIALS, "\n", "  ", *(f"<0x{b:02X}>" for b in range(256)), *PIECES]
TYPES = [3] * len(SPECIALS) + [4, 4] + [6] * 256 + [1] * len(PIECES)  # control, user-defined, byte, normal
SCORES = [-1000.0] * (len(SPECIALS) + 2 + 256) + [float(i) for i in range(len(PIECES))]  # rising: not a rank
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def write_gemma3_gguf(path: Path, model: Any) -> Path:
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(c.sliding_window)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_scores(SCORES)
    w.add_token_types(TYPES)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        array = tensor.float().numpy()
        if name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp's converter stores Gemma's norms as 1 + w
        w.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A Gemma 3 of llama.cpp's assumptions (every 6th layer full, query_pre_attn_scalar = head_dim,
    local base 10,000) and its GGUF."""
    require(importlib.util.find_spec("gguf"), "the gguf package is not installed (pip install gguf)")
    root = tmp_path_factory.mktemp("gemma3-gguf")
    model, _ = gemma3(root / "hf", seed=8, vocab_size=len(TOKENS), layer_types=None, query_pre_attn_scalar=16,
                      bos_token_id=2, eos_token_id=1)
    return model, write_gemma3_gguf(root / "tiny-gemma3.gguf", model)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVSTORE_MODEL_CACHE", str(tmp_path / "models"))
    return tmp_path / "models"


def test_the_copy_has_the_models_weights_and_layers_back(tiny: tuple[Any, Path], cache: Path) -> None:
    model, path = tiny
    loaded = load_checkpoint(path)
    c = loaded.config
    assert c.model_type == "gemma3_text" and c.hidden_act == "gelu_pytorch_tanh" and c.tie_word_embeddings
    assert [s.window for s in c.layer_specs] == [8, 8, 8, 8, 8, None]
    assert (c.rope_theta, c.sliding_rope_theta, c.query_pre_attn_scalar) == (1e6, 1e4, 16)
    assert c.eos_token_ids == (1, TOKENS.index("<end_of_turn>"))
    theirs = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert sorted(loaded.weights) == sorted(theirs)
    for name, tensor in theirs.items():  # exact, but norms: (1 + w) - 1 in float32 is w to within 1 + w's last bit
        torch.testing.assert_close(loaded.weights[name], tensor, atol=0 if "norm" not in name else 2.4e-7, rtol=0)


def test_the_engine_runs_it_as_transformers_runs_the_model(tiny: tuple[Any, Path], cache: Path) -> None:
    model, path = tiny
    prompts = [[2, *range(270, 280)], [2, *range(265, 287), 9, 11]]  # past the window of 8
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logits=True)
    with LLMEngine(str(path), dtype=torch.float32, block_size=4, kv_cache_bytes=1 << 20, host_bytes=0) as llm:
        for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
            assert out.prompt_logits is not None
            torch.testing.assert_close(out.prompt_logits, hf_greedy_check(model, prompt, out.token_ids),
                                       atol=1e-4, rtol=1e-4)


def test_the_tokenizer_reads_as_transformers_reads_the_file(tiny: tuple[Any, Path], cache: Path) -> None:
    require(importlib.util.find_spec("transformers"), "transformers is not installed (pip extra 'test')")
    from transformers import AutoTokenizer

    _, path = tiny
    mine = load_checkpoint(path).tokenizer
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["abc", "hello user", " hello  user\n\nabc", "<start_of_turn>user\nhe<end_of_turn>\n", "Grüße"]:
        ids = mine.encode(text).ids
        assert ids == theirs(text)["input_ids"], (text, ids, theirs(text)["input_ids"])
        assert mine.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    # the file's order, not its scores: "ab" merges before "bc"
    assert mine.encode("abc", add_special_tokens=False).ids == [TOKENS.index("ab"), TOKENS.index("c")]


def test_the_copy_gets_a_gemma_chat_template(tiny: tuple[Any, Path], cache: Path) -> None:
    from kvstore.services.engine_server.tokenizer import load_tokenizer, render_chat

    _, path = tiny
    copy = convert_gguf(path)
    assert (copy.path / "chat_template.jinja").read_text() == GEMMA3_CHAT_TEMPLATE
    served = load_tokenizer(str(path), load_checkpoint(path).tokenizer)
    assert served.chat_template == GEMMA3_CHAT_TEMPLATE and served.bos_token == "<bos>"
    chat = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hello?"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "abc"}]
    assert render_chat(served.chat_template, chat, served.bos_token, served.eos_token) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHello?<end_of_turn>\n<start_of_turn>model\nHi.<end_of_turn>\n"
        "<start_of_turn>user\nabc<end_of_turn>\n<start_of_turn>model\n")
    ids = served.encode_chat([{"role": "user", "content": "abc"}])
    # <bos> <start_of_turn> user \n a b c <end_of_turn> \n <start_of_turn> m o d e l \n
    assert ids[:2] == [2, TOKENS.index("<start_of_turn>")] and ids[-2:] == [TOKENS.index("l"), TOKENS.index("\n")]
    assert ids.count(2) == 1  # the template writes <bos>; the tokenizer adds no second one
