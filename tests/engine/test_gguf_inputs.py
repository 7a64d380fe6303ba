"""GGUF checkpoints written here with the ``gguf`` package's writer, in llama.cpp's layout (q/k
rows permuted as its converter permutes them), from the seeded random model: the converted copy
has the original weights back, the engine runs it as it runs the Hugging Face directory, the
tokenizer and chat template come from the metadata, the cache is reused, and rebuilt when it is
damaged; bad files are a CheckpointError that says what is wrong."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.engine import CheckpointError, LLMEngine, SamplingParams
from kvstore.engine.checkpoint import (
    Checkpoint,
    ModelConfig,
    load_checkpoint,
    random_checkpoint,
    save_random_checkpoint,
)
from kvstore.engine.checkpoint.model_cache import MANIFEST, convert_gguf

from factories import require

MODEL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16, max_position_embeddings=256, rope_theta=50000.0)
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "Ġ t", "Ġt he"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


@pytest.fixture(autouse=True)
def _gguf_installed() -> None:
    require(importlib.util.find_spec("gguf"), "the gguf package is not installed (pip install gguf)")


def vocab() -> list[str]:
    """128 byte-level tokens: the specials, printable ASCII, 'Ġ' and 'Ċ' (space and newline), three
    merges, fillers."""
    tokens = [*SPECIALS, *(chr(c) for c in range(ord("!"), ord("~") + 1)), "Ġ", "Ċ", "he", "Ġt", "Ġthe"]
    return tokens + [f"<extra_{i}>" for i in range(MODEL["vocab_size"] - len(tokens))]


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute`` (the layout a GGUF stores q/k in)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def gpt2_vocab(model: str = "gpt2") -> dict[str, Any]:
    tokens = vocab()
    return {"model": model, "pre": "smollm", "tokens": tokens, "types": [3 if t in SPECIALS else 1 for t in tokens],
            "merges": MERGES}


def write_gguf(path: Path, ckpt: Checkpoint, arch: str = "llama", quant: str | None = None,
               tokenizer: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> Path:
    """``ckpt`` as llama.cpp would write it: metadata, tokenizer (default ``gpt2_vocab()``), tensors
    (``quant``: matrices quantized so)."""
    import gguf

    c = ckpt.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    tok = tokenizer or gpt2_vocab()
    w.add_tokenizer_model(tok["model"])
    if "pre" in tok:
        w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    if "merges" in tok:
        w.add_token_merges(tok["merges"])
    if "scores" in tok:
        w.add_token_scores(tok["scores"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template(TEMPLATE)
    for key, value in (extra or {}).items():  # (a key written above is overwritten)
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for name, tensor in ckpt.weights.items():
        array = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, c.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, c.num_kv_heads)
        if quant and array.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quant]
            w.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Checkpoint, Path, Path]:
    """The random model, its Hugging Face directory and its GGUF (float32)."""
    ckpt = random_checkpoint(MODEL, 7)
    root = tmp_path_factory.mktemp("tiny")
    save_random_checkpoint(root / "hf", ckpt)
    return ckpt, root / "hf", write_gguf(root / "tiny.gguf", ckpt)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh model cache, also where an LLMEngine looks (``$KVSTORE_MODEL_CACHE``)."""
    monkeypatch.setenv("KVSTORE_MODEL_CACHE", str(tmp_path / "models"))
    return tmp_path / "models"


def test_the_copy_has_the_original_weights_back(tiny: tuple[Checkpoint, Path, Path], cache: Path) -> None:
    ckpt, _, path = tiny
    loaded = load_checkpoint(path)
    assert loaded.config.rms_norm_eps == pytest.approx(ckpt.config.rms_norm_eps)  # float32 in the file
    assert loaded.config == replace(ckpt.config, eos_token_ids=(2,), rms_norm_eps=loaded.config.rms_norm_eps)
    assert sorted(loaded.weights) == sorted(ckpt.weights)
    for name, tensor in ckpt.weights.items():  # exact: float32 in, float32 out, q/k un-permuted
        assert torch.equal(loaded.weights[name], tensor), name
    assert loaded.model_id.startswith("tiny:")


def test_the_engine_runs_the_gguf_as_the_hf_directory(tiny: tuple[Checkpoint, Path, Path], cache: Path) -> None:
    _, hf_dir, path = tiny
    prompts = [[5, 9, 33, 7], list(range(40, 61))]
    outputs = []
    for model in (hf_dir, path):
        with LLMEngine(str(model), dtype=torch.float32, block_size=4, kv_cache_bytes=1 << 20, host_bytes=0) as llm:
            outputs.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q8_0_tensors_dequantize_to_the_readers_values(arch: str, tmp_path: Path, cache: Path) -> None:
    import gguf

    overrides = {**MODEL, "tie_word_embeddings": arch == "qwen2", "qkv_bias": arch == "qwen2"}
    if arch == "qwen2":
        overrides["model_type"] = "qwen2"
    ckpt = random_checkpoint(overrides, 3)
    if arch == "qwen2":  # the random model has no biases: give qwen2 its q/k/v ones
        gen = torch.Generator().manual_seed(5)
        for i in range(MODEL["num_layers"]):
            for p, rows in (("q", 64), ("k", 32), ("v", 32)):
                ckpt.weights[f"model.layers.{i}.self_attn.{p}_proj.bias"] = torch.randn(rows, generator=gen)
    loaded = load_checkpoint(write_gguf(tmp_path / f"{arch}.gguf", ckpt, arch, quant="Q8_0"))
    assert loaded.config.model_type == arch and loaded.config.qkv_bias == (arch == "qwen2")
    assert loaded.config.tie_word_embeddings == (arch == "qwen2") and sorted(loaded.weights) == sorted(ckpt.weights)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, tensor in ckpt.weights.items():
        want = tensor.numpy()
        if want.ndim == 2:
            want = gguf.quants.dequantize(gguf.quants.quantize(want, q8), q8)  # the round trip llama.cpp's file holds
        assert np.array_equal(loaded.weights[name].numpy(), want), name
    with LLMEngine(str(tmp_path / f"{arch}.gguf"), dtype=torch.float32, block_size=4, kv_cache_bytes=1 << 20,
                   host_bytes=0) as llm:
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 8


def test_tokenizer_and_template_come_from_the_metadata(tiny: tuple[Checkpoint, Path, Path], cache: Path) -> None:
    from kvstore.services.engine_server.tokenizer import load_tokenizer

    loaded = load_checkpoint(tiny[2])
    tokens = vocab()
    encoded = loaded.tokenizer.encode("the <|im_end|>he 42")
    # add_bos_token: BOS first; "the" is t + he (merges); the control token whole; digits one by one
    assert encoded.ids == [1, tokens.index("t"), tokens.index("he"), tokens.index("Ġ"), 2, tokens.index("he"),
                           tokens.index("Ġ"), tokens.index("4"), tokens.index("2")]
    assert loaded.tokenizer.encode(" the", add_special_tokens=False).ids == [tokens.index("Ġthe")]
    assert loaded.tokenizer.decode(encoded.ids) == "the he 42"  # specials skipped
    served = load_tokenizer(str(tiny[2]), loaded.tokenizer)
    assert served.chat_template == TEMPLATE and served.bos_token == "<|im_start|>" and served.eos_token == "<|im_end|>"
    # the template writes the specials; the tokenizer adds no second BOS
    assert served.encode_chat([{"role": "user", "content": "he"}]) == [
        1, *(tokens.index(ch) for ch in "user"), tokens.index("Ċ"), tokens.index("he"), 2, tokens.index("Ċ")]


def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_reads_it(tmp_path: Path, cache: Path) -> None:
    """Llama 1/2-style files: no merges (recovered from the scores), byte fallback, a '▁' prefix."""
    require(importlib.util.find_spec("transformers"), "transformers is not installed (pip extra 'test')")
    from transformers import AutoTokenizer

    pieces = ["▁", "a", "e", "h", "l", "o", "t", "w", "r", "d", "he", "ll", "▁t", "▁the", "llo", "▁w", "or", "▁wor",
              "▁world", "▁he", "▁hello", "ld"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]  # unknown, control, byte, normal
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]  # earlier pieces merge first
    spm = {"model": "llama", "tokens": tokens, "types": types, "scores": scores}
    path = write_gguf(tmp_path / "spm.gguf", random_checkpoint({**MODEL, "vocab_size": len(tokens)}, 2),
                      tokenizer=spm)
    mine = load_checkpoint(path).tokenizer
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ["hello world", "the world", " hello  there\n", "Grüße", "a", "</s> he"]:
        ids = mine.encode(text).ids
        assert ids == theirs(text)["input_ids"], (text, ids, theirs(text)["input_ids"])
        assert mine.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert mine.encode("hello").ids[0] == 1  # add_bos_token


def test_the_second_load_reuses_the_copy(tiny: tuple[Checkpoint, Path, Path], cache: Path) -> None:
    first = convert_gguf(tiny[2])
    assert first.built and first.path.parent == cache
    assert sorted(p.name for p in first.path.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", MANIFEST, "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
    again = convert_gguf(tiny[2])
    assert not again.built and again.path == first.path and again.sha256 == first.sha256
    assert [p.name for p in cache.iterdir()] == [first.sha256]  # no temporary directory left


@pytest.mark.parametrize("damage", ["flipped byte", "truncated weights", "no manifest", "missing tokenizer",
                                    "stale converter"])
def test_a_damaged_copy_is_rebuilt_not_trusted(damage: str, tiny: tuple[Checkpoint, Path, Path], cache: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    entry = convert_gguf(tiny[2]).path
    weights = entry / "model.safetensors"
    if damage == "flipped byte":
        with open(weights, "r+b") as fh:  # a weight's byte, past the header: the file still parses
            fh.seek(weights.stat().st_size - 3)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0x40]))
    elif damage == "truncated weights":
        os.truncate(weights, weights.stat().st_size // 2)
    elif damage == "no manifest":
        (entry / MANIFEST).unlink()
    elif damage == "missing tokenizer":
        (entry / "tokenizer.json").unlink()
    else:
        manifest = json.loads((entry / MANIFEST).read_text())
        (entry / MANIFEST).write_text(json.dumps({**manifest, "converter": 0}))
    with caplog.at_level(logging.WARNING, logger="kvstore.engine"):
        rebuilt = convert_gguf(tiny[2])
    assert rebuilt.built and rebuilt.path == entry
    assert "not usable" in caplog.text and "rebuilding" in caplog.text
    assert torch.equal(load_checkpoint(tiny[2]).weights["model.norm.weight"], tiny[0].weights["model.norm.weight"])
    assert not convert_gguf(tiny[2]).built


def test_bad_files_are_checkpoint_errors(tiny: tuple[Checkpoint, Path, Path], tmp_path: Path, cache: Path) -> None:
    path = tiny[2]
    data = path.read_bytes()

    def fails(model: Path, match: str) -> None:
        with pytest.raises(CheckpointError, match=match):
            LLMEngine(str(model), dtype=torch.float32, kv_cache_bytes=1 << 20, host_bytes=0)

    fails(tmp_path / "missing.gguf", r"model .*missing\.gguf does not exist")
    (tmp_path / "notes.txt").write_text("just some text")
    fails(tmp_path / "notes.txt", r"notes\.txt is not a GGUF file \(it starts with b'just'")
    (tmp_path / "empty.gguf").write_bytes(b"")
    fails(tmp_path / "empty.gguf", r"empty\.gguf is not a GGUF file \(it starts with b''")
    (tmp_path / "header.gguf").write_bytes(data[:40])  # inside the metadata
    fails(tmp_path / "header.gguf", r"cannot read GGUF .*header\.gguf \(40 bytes\): it is truncated or corrupt")
    (tmp_path / "half.gguf").write_bytes(data[: len(data) // 2])  # inside the tensor data
    fails(tmp_path / "half.gguf", r"half\.gguf .*truncated")
    (tmp_path / "short.gguf").write_bytes(data[:-1])  # one byte short
    fails(tmp_path / "short.gguf", r"short\.gguf .*truncated")
    assert not cache.exists() or not any(cache.iterdir())  # nothing half-built was kept


@pytest.mark.parametrize(("arch", "extra", "match"), [
    ("falcon", {}, r"general\.architecture 'falcon' is not supported; supported: \['llama', 'qwen2', 'gemma3'\]"),
    ("llama", {"llama.expert_count": 8}, "mixture of experts"),
    ("llama", {"split.count": 3}, "one of 3 split files"),
    ("llama", {"llama.rope.scaling.type": "yarn"}, "rope scaling 'yarn' is not supported"),
    ("llama", {"tokenizer": "bert"}, r"tokenizer\.ggml\.model 'bert' is not supported; supported: \['gpt2', 'llama'\]"),
])
def test_a_model_the_engine_lacks_is_a_checkpoint_error(arch: str, extra: dict[str, Any], match: str,
                                                        tmp_path: Path, cache: Path) -> None:
    extra = dict(extra)
    path = write_gguf(tmp_path / "m.gguf", random_checkpoint(MODEL, 1), arch,
                      tokenizer=gpt2_vocab(extra.pop("tokenizer", "gpt2")), extra=extra)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path)
    assert not (cache.exists() and any(cache.iterdir()))  # no entry, no temporary directory


def test_an_unwritable_cache_is_a_checkpoint_error(tiny: tuple[Checkpoint, Path, Path], tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match=r"cannot write the converted copy .*KVSTORE_MODEL_CACHE"):
        convert_gguf(tiny[2], blocker / "models")


def test_hf_directories_still_load(tiny: tuple[Checkpoint, Path, Path], tmp_path: Path) -> None:
    copy = shutil.copytree(tiny[1], tmp_path / "hf")
    loaded = load_checkpoint(copy)
    assert loaded.model_id.startswith("hf:") and torch.equal(loaded.weights["model.norm.weight"],
                                                             tiny[0].weights["model.norm.weight"])


# ------------------------------------------------------------------------- fuzz regressions
# Found by the gguf and gguf_tokenizer fuzz harnesses (fuzz/regressions/gguf*/): each was another
# error than CheckpointError, a hang, or a file accepted that the engine cannot run.


@pytest.mark.timeout(60)
def test_an_array_claiming_more_values_than_the_file_holds_is_a_checkpoint_error(
        tiny: tuple[Checkpoint, Path, Path], tmp_path: Path, cache: Path) -> None:
    """The gguf package reads past the end of a file as empty arrays: an array of numbers that
    claimed 2**60 entries looped for ever, growing a list of them."""
    import gguf

    data = bytearray(tiny[2].read_bytes())
    key = "tokenizer.ggml.token_type"
    field = gguf.GGUFReader(tiny[2]).fields[key]
    count_at = field.offset + 8 + len(key) + 4 + 4  # key length, key, value type, item type
    assert int.from_bytes(data[count_at:count_at + 8], "little") == len(vocab())
    data[count_at:count_at + 8] = (1 << 60).to_bytes(8, "little")
    data += bytes(-(len(data) - count_at - 8) % 4)  # whole int32s to the end: then reads past it are empty
    (tmp_path / "lying.gguf").write_bytes(data)
    with pytest.raises(CheckpointError, match=r"lying\.gguf .*truncated or corrupt .*run past the end of the file"):
        convert_gguf(tmp_path / "lying.gguf")


@pytest.mark.parametrize(("extra", "match"), [
    # a list of one entry per layer (gemma3: at conversion, minutes and GBs; llama: at load)
    ({"llama.block_count": 2**32 - 1}, r"llama\.block_count is 4294967295, not 1 to 4096"),
    ({"llama.context_length": math.inf}, r"llama\.context_length is inf, not a \(finite\) number"),  # OverflowError
    ({"llama.feed_forward_length": math.nan}, r"llama\.feed_forward_length is nan"),  # ValueError
    # numpy's reshape error un-permuting q
    ({"llama.attention.key_length": 15, "llama.rope.dimension_count": 15}, r"head_dim 15 is odd"),
])
def test_metadata_out_of_range_is_a_checkpoint_error(extra: dict[str, Any], match: str, tmp_path: Path,
                                                     cache: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", random_checkpoint(MODEL, 1), extra=extra)
    with pytest.raises(CheckpointError, match=match):
        convert_gguf(path)


@pytest.mark.parametrize(("fields", "match"), [
    ({"num_kv_heads": -2}, "num_kv_heads must be positive, got -2"),  # 4 % -2 == 0: it was accepted
    ({"num_kv_heads": 0}, "num_kv_heads must be positive, got 0"),  # ZeroDivisionError
    ({"num_heads": -4}, "num_heads must be positive, got -4"),
    ({"num_layers": 10**9}, "num_layers=1000000000 is out of range: 1 to 4096"),
])
def test_model_config_refuses_counts_out_of_range(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        ModelConfig(**{"num_heads": 4, "num_kv_heads": 2, **fields})
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=1000000000 is out of range"):  # before a list
        ModelConfig.from_hf({"model_type": "gemma3_text", "num_attention_heads": 4, "hidden_size": 64,
                             "num_hidden_layers": 10**9, "vocab_size": 8, "intermediate_size": 8})


def gpt2_metadata(**change: Any) -> dict[str, Any]:
    """``gpt2_vocab()`` as the GGUF reader hands it to ``build_tokenizer``, with ``change``."""
    tok = gpt2_vocab()
    meta = {f"tokenizer.ggml.{k}": tok[k] for k in ("model", "pre", "tokens", "merges")}
    meta.update({"tokenizer.ggml.token_type": tok["types"], "tokenizer.ggml.bos_token_id": 1,
                 "tokenizer.ggml.add_bos_token": True})
    return {**meta, **{f"tokenizer.ggml.{k}": v for k, v in change.items()}}


@pytest.mark.parametrize(("change", "match"), [
    ({"merges": [*MERGES, "j l"]}, r"merges\[3\] is 'j l', not two tokens of its vocabulary"),  # tokenizers' Exception
    ({"merges": [*MERGES, "he"]}, r"merges\[3\] is 'he'"),  # TypeError
    ({"merges": [*MERGES, 7]}, r"merges\[3\] is 7"),  # AttributeError
    ({"tokens": [*vocab(), 7]}, "tokenizer.ggml.tokens holds 129 values, not all strings"),  # TypeError
    ({"token_type": 1}, "tokenizer.ggml.token_type is a int, not a list"),  # TypeError
    ({"model": "llama", "scores": [0.0] * 127 + ["high"]}, "no tokenizer.ggml.scores for its 128 tokens"),  # TypeError
    ({"tokens": ["<|endoftext|>", "$foo", *vocab()[2:]]}, r"BOS token '\$foo' starts with '\$'"),  # ValueError
    ({"tokens": ["<|endoftext|>", "$A", *vocab()[2:]]}, r"BOS token '\$A'"),  # the prompt came twice
    ({"tokens": ["<|endoftext|>", ":", *vocab()[2:]]}, r"BOS token ':' cannot be prepended"),  # ValueError
    ({"tokens": ["<|endoftext|>", "x:1", *vocab()[2:]]}, r"BOS token 'x:1' cannot be prepended"),
])
def test_malformed_tokenizer_metadata_is_a_checkpoint_error(change: dict[str, Any], match: str) -> None:
    from kvstore.engine.checkpoint.gguf_tokenizer import build_tokenizer

    with pytest.raises(CheckpointError, match=match):
        build_tokenizer(gpt2_metadata(**change))


def test_a_pre_tokenizer_that_is_no_name_splits_as_gpt2() -> None:
    """As an unknown name does (it was a TypeError: a list is no dict key)."""
    from kvstore.engine.checkpoint.gguf_tokenizer import build_tokenizer

    tokens = vocab()
    assert build_tokenizer(gpt2_metadata(pre=["smollm"])).encode("the 42").ids == [
        1, tokens.index("t"), tokens.index("he"), tokens.index("Ġ"), tokens.index("4"), tokens.index("2")]


def test_a_gemma3_unknown_token_of_spaces_is_looked_up_as_respelled() -> None:
    """Gemma's tokens of spaces are respelled with "▁" in the vocabulary, but the unknown token was
    looked up as the file spells it: encoding a character the vocabulary lacks raised the
    tokenizers library's "Unk token ` ` not found in the vocabulary"."""
    from kvstore.engine.checkpoint.gguf_tokenizer import build_tokenizer

    meta = {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [" ", "a"],
            "tokenizer.ggml.scores": [0.0, 0.0], "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_space_prefix": False}
    assert build_tokenizer(meta).encode("ab").ids == [1, 0]  # "b" is unknown: the respelled " "
