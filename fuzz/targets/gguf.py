"""The GGUF reader: a downloaded ``.gguf`` file turned into the Hugging Face copy the engine
loads (``write_hf_copy``, what ``convert_gguf`` runs for every model path that is a file), and
that copy read back (``load_dir``, what ``load_checkpoint`` and ``read_model_config`` then read).

Input: the whole file. The harness writes it to one temporary path and converts it into one
temporary directory. What must hold:

- the conversion refuses a truncated, corrupt or unsupported file with CheckpointError (never
  an IndexError, struct or numpy error, MemoryError, or an allocation a lying length field
  asks for: a huge count is refused before anything of its size is built);
- a file it accepts leaves a copy that reads back: one weight per tensor of the file, each of
  the tensor's element count, a ModelConfig that obeys its invariants (positive sizes, query
  heads a multiple of KV heads, one attention spec per layer or none), and a tokenizer that
  encodes and decodes text.

Seeds are small: every tensor's bytes are in the file, so dequantizing them all stays cheap.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.engine.checkpoint import gguf_reader
from kvstore.engine.checkpoint.gguf_reader import write_hf_copy
from kvstore.engine.checkpoint.hf_dir import load_dir
from kvstore.engine.checkpoint.types import CheckpointError

SAMPLE_TEXT = "Hello world, 12 apples!\n<|im_start|>user"


def make() -> Callable[[bytes], None]:
    shm = Path("/dev/shm")  # in memory where there is one: an input writes a dozen files
    root = Path(tempfile.mkdtemp(prefix="kvstore-fuzz-gguf-", dir=shm if shm.is_dir() else None))
    atexit.register(shutil.rmtree, root, True)
    path, out = root / "model.gguf", root / "copy"
    out.mkdir()
    # the reader write_hf_copy opens, kept (for the call only) to compare its tensors with the
    # copy's weights: reading the file a second time would double the cost of an input
    opened: list[Any] = []
    real_open = gguf_reader._open

    def remembering_open(src: Path) -> Any:
        opened.append(real_open(src))
        return opened[-1]

    def check(data: bytes) -> None:
        opened.clear()  # (before the file under its memory map is rewritten)
        path.write_bytes(data)
        for old in out.iterdir():
            old.unlink()
        gguf_reader._open = remembering_open
        try:
            write_hf_copy(path, out)
        except CheckpointError:
            return
        finally:
            gguf_reader._open = real_open
        try:
            ckpt = load_dir(out, "fuzz")
        except CheckpointError as exc:
            raise AssertionError(f"the converted copy does not read back: {exc}") from None
        _check_config(ckpt.config)
        _check_weights(opened[0].tensors, ckpt.weights)
        if ckpt.tokenizer is not None:
            ids = ckpt.tokenizer.encode(SAMPLE_TEXT).ids
            ckpt.tokenizer.decode(ids)

    return check


def _check_config(config: Any) -> None:
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim"):
        assert getattr(config, name) > 0, f"ModelConfig.{name} is {getattr(config, name)}"
    assert config.num_heads % config.num_kv_heads == 0, (config.num_heads, config.num_kv_heads)
    assert len(config.attention) in (0, config.num_layers), (len(config.attention), config.num_layers)


def _check_weights(tensors: list[Any], weights: dict[str, Any]) -> None:
    assert len(weights) == len(tensors), f"{len(tensors)} tensors in the file, {len(weights)} in the copy"
    counts = sorted(int(t.n_elements) for t in tensors)
    assert counts == sorted(w.numel() for w in weights.values()), "a tensor changed its element count"


# --- seeds ------------------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, FFN = 32, 2, 1, 32  # Q8_0 packs rows of 32
GPT2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GPT2_MERGES = ["H e", "l l", "Ġ w", "o r", "He ll"]


def _gpt2_vocab() -> tuple[list[str], list[int]]:
    tokens = [*GPT2_SPECIALS, *(chr(c) for c in range(ord("!"), ord("~") + 1)), "Ġ", "Ċ", "He", "ll", "Ġw", "or",
              "Hell"]
    return tokens, [3 if t in GPT2_SPECIALS else 1 for t in tokens]


def _spm_vocab() -> tuple[list[str], list[int], list[float]]:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["▁", "H", "e", "l", "o", "w", "r", "d", "he", "ll", "▁w", "or", "llo", "▁wor"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(0x20, 0x80)]  # ASCII's printable bytes: the seed stays small
    tokens = [*specials, "  ", *byte_tokens, *pieces]
    types = [3] * len(specials) + [4] + [6] * len(byte_tokens) + [1] * len(pieces)
    scores = [0.0] * (len(specials) + 1 + len(byte_tokens)) + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def _tensors(vocab: int, gemma: bool) -> dict[str, tuple[np.ndarray, str]]:
    """One layer's tensors, each (float32 values, GGML type name)."""
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)

    norm = np.ones(HIDDEN, dtype=np.float32)
    out = {
        "token_embd.weight": (mat(vocab, HIDDEN), "Q8_0"),
        "output_norm.weight": (norm, "F32"),
        "blk.0.attn_norm.weight": (norm, "F32"),
        "blk.0.ffn_norm.weight": (norm, "F32"),
        "blk.0.attn_q.weight": (mat(HEADS * head_dim, HIDDEN), "Q8_0"),
        "blk.0.attn_k.weight": (mat(KV_HEADS * head_dim, HIDDEN), "Q8_0"),
        "blk.0.attn_v.weight": (mat(KV_HEADS * head_dim, HIDDEN), "F16"),
        "blk.0.attn_output.weight": (mat(HIDDEN, HEADS * head_dim), "Q8_0"),
        "blk.0.ffn_gate.weight": (mat(FFN, HIDDEN), "Q8_0"),
        "blk.0.ffn_up.weight": (mat(FFN, HIDDEN), "F16"),
        "blk.0.ffn_down.weight": (mat(HIDDEN, FFN), "F32"),
    }
    if gemma:
        head_norm = np.ones(head_dim, dtype=np.float32)
        out.update({"blk.0.post_attention_norm.weight": (norm, "F32"), "blk.0.post_ffw_norm.weight": (norm, "F32"),
                    "blk.0.attn_q_norm.weight": (head_norm, "F32"), "blk.0.attn_k_norm.weight": (head_norm, "F32")})
    else:
        out["output.weight"] = (mat(vocab, HIDDEN), "Q8_0")
    return out


def _write(arch: str, keys: Callable[[Any], None], tensors: dict[str, tuple[np.ndarray, str]]) -> bytes:
    import gguf

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "seed.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        keys(w)
        for name, (array, kind) in tensors.items():
            qtype = gguf.GGMLQuantizationType[kind]
            if kind == "F32":
                w.add_tensor(name, array)
            elif kind == "F16":
                w.add_tensor(name, array.astype(np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path.read_bytes()


def _model_keys(w: Any, vocab: int) -> None:
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)


def _llama_seed() -> bytes:
    tokens, types = _gpt2_vocab()

    def keys(w: Any) -> None:
        _model_keys(w, len(tokens))
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(GPT2_MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")

    return _write("llama", keys, _tensors(len(tokens), gemma=False))


def _gemma3_seed() -> bytes:
    tokens, types, scores = _spm_vocab()

    def keys(w: Any) -> None:
        _model_keys(w, len(tokens))
        w.add_key_length(HIDDEN // HEADS)
        w.add_value_length(HIDDEN // HEADS)
        w.add_sliding_window(8)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)

    return _write("gemma3", keys, _tensors(len(tokens), gemma=True))


def _smollm2_metadata(keep_tokens: int = 400) -> bytes | None:
    """SmolLM2's real metadata (every key, in its order and types), its vocabulary cut to the
    first ``keep_tokens`` tokens and the merges among them, and no tensors: the header and
    metadata of the file the engine serves by default, small."""
    import gguf

    from kvstore.engine.checkpoint.bundled import smollm2_gguf

    real = smollm2_gguf()
    if real is None:
        return None
    reader = gguf.GGUFReader(real)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()[:keep_tokens]
    known = set(tokens)
    merges = [m for m in reader.fields["tokenizer.ggml.merges"].contents()
              if (pair := m.split(" ", 1)) and all(p in known for p in pair) and "".join(pair) in known]
    cut = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
           "tokenizer.ggml.token_type": reader.fields["tokenizer.ggml.token_type"].contents()[:keep_tokens]}

    def keys(w: Any) -> None:
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            value = cut.get(name, field.contents())
            sub_type = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(name, value, field.types[0], sub_type=sub_type)

    return _write(str(reader.fields["general.architecture"].contents()), keys, {})


def seeds() -> dict[str, bytes]:
    """A one-layer llama (byte-level BPE) and gemma3 (sentencepiece) with F32, F16 and Q8_0
    tensors, written by the gguf package's GGUFWriter; SmolLM2's real metadata, small."""
    out = {"llama-gpt2-f32-f16-q8_0": _llama_seed(), "gemma3-spm-f32-f16-q8_0": _gemma3_seed()}
    smollm2 = _smollm2_metadata()
    if smollm2 is not None:
        out["smollm2-metadata-400-tokens"] = smollm2
    return out
