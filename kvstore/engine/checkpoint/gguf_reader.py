"""GGUF reading: a GGUF file (llama.cpp's one-file format) written out as the Hugging Face
checkpoint that ``hf_dir`` reads; ``model_cache`` keeps these copies.

``write_hf_copy(src, out)`` writes:

- ``model.safetensors``: every tensor dequantized with the ``gguf`` package's reader, under the
  engine's names, q/k rows un-permuted (llama.cpp's converter reorders them for its rotary
  layout); float32, or float16/bfloat16 where the file stores those unquantized.
- ``config.json`` and ``generation_config.json``: from the ``{arch}.*`` metadata.
- ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``: from ``tokenizer.*``
  (``gguf_tokenizer``).

Gemma 3 (``gemma3``) differs from the Llama layout in what the file leaves out or changes:

- llama.cpp's converter stores every norm weight as ``1 + w`` (Gemma's RMSNorm scales by
  ``1 + w``); the copy gets ``w`` back (``w = stored - 1``), as transformers' GGUF loader does.
  Checked on Gemma-3-270M's file: ``stored - 1`` of every norm is a bfloat16 value (the
  checkpoint's dtype), ``stored`` itself often is not.
- The layer pattern is not in the metadata: llama.cpp and transformers both take every 6th layer
  as full attention, the others sliding (layers 5, 11, 17 of 18), the window being
  ``gemma3.attention.sliding_window``.
- Sliding layers rotate with base 10,000 (llama.cpp's fixed local base; transformers' default
  ``rope_local_base_freq``); full layers with ``gemma3.rope.freq_base``, and its linear scaling if
  the file has one (the 4B and larger models).
- ``query_pre_attn_scalar`` is not in the metadata: head_dim, but hidden / heads for the 27B
  (62 layers), as llama.cpp computes the attention scale.
- The file ends turns with ``<end_of_turn>``: it joins ``eos`` as a stop token; and it has no
  chat template, so the copy gets ``GEMMA3_CHAT_TEMPLATE``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import torch

from kvstore.engine.checkpoint.gguf_tokenizer import GEMMA3_CHAT_TEMPLATE, build_tokenizer, special_token
from kvstore.engine.checkpoint.types import FULL, MAX_LAYERS, SLIDING, CheckpointError, ModelConfig

log = logging.getLogger("kvstore.engine")

ARCHITECTURES = ("llama", "qwen2", "gemma3")  # general.architecture values the engine runs
GGUF_MAGIC = b"GGUF"

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3's norms: llama.cpp's ffn_norm is the norm before the MLP (Llama's post_attention_layernorm)
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
GEMMA3_FULL_EVERY = 6  # every 6th Gemma 3 layer is full attention (not in the metadata)
GEMMA3_LOCAL_ROPE_BASE = 10_000.0  # Gemma 3's sliding layers' RoPE base (not in the metadata)
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def write_hf_copy(src: Path, out: Path) -> None:
    """Write the GGUF ``src`` into the (empty) directory ``out`` as a Hugging Face checkpoint.

    Raises:
        CheckpointError: a truncated or unreadable file, or a model the engine cannot run.
    """
    from safetensors.torch import save_file

    reader = _open(src)
    meta = _metadata(reader)
    config, generation = hf_config(meta, [t.name for t in reader.tensors], src)
    # refuse what the engine cannot run, or tokenize, before the slow part (dequantizing)
    ModelConfig.from_hf(config, generation)
    tokenizer = build_tokenizer(meta) if "tokenizer.ggml.tokens" in meta else None
    save_file(_weights(reader, config), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer is not None:
        tokenizer.save(str(out / "tokenizer.json"))
        names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
        tok_cfg: dict[str, Any] = {k: special_token(meta, v) for k, v in names.items()}
        tok_cfg.update(tokenizer_class="PreTrainedTokenizerFast",
                       model_max_length=config["max_position_embeddings"])
        (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    template = meta.get("tokenizer.chat_template")
    if not (isinstance(template, str) and template) and config["model_type"] == "gemma3_text" and tokenizer:
        template = GEMMA3_CHAT_TEMPLATE
    if isinstance(template, str) and template:
        (out / "chat_template.jinja").write_text(template)


def _open(src: Path) -> Any:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError(f"reading {src.name} needs the gguf package: pip install gguf") from None

    class BoundedReader(GGUFReader):
        """The gguf package's reader, but a read past the end of the file fails: its own returns
        a short array, so a lying count (an array of 2**60 numbers) loops for ever, growing a
        list, instead of failing."""

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            values = super()._get(offset, dtype, count, override_order)
            if len(values) != int(count):
                raise ValueError(f"{int(count)} values at byte {offset} run past the end of the file")
            return values

    try:
        reader = BoundedReader(src)
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors on a bad file
        raise CheckpointError(f"cannot read GGUF {src} ({src.stat().st_size} bytes): it is truncated or "
                              f"corrupt ({type(exc).__name__}: {exc})") from None
    size = src.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise CheckpointError(f"GGUF {src} is truncated: its tensors end at byte {end}, the file has {size}")
    return reader


def _metadata(reader: Any) -> dict[str, Any]:
    """Key -> value (str, number, bool, or a list of them); a field the reader cannot decode is
    left out (a missing key the engine needs is then named by ``hf_config``)."""
    meta = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):  # the header's own fields
            continue
        try:
            meta[name] = field.contents()
        except (ValueError, TypeError, IndexError, UnicodeDecodeError):
            log.debug("GGUF field %s cannot be decoded; skipped", name)
    return meta


def hf_config(meta: dict[str, Any], tensor_names: list[str], src: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.json and generation_config.json for a GGUF's metadata (the keys llama.cpp writes)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{src.name}: general.architecture {arch!r} is not supported; "
                              f"supported: {list(ARCHITECTURES)}")

    def get(key: str, default: Any = None, kind: type = int) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{src.name} has no {arch}.{key} in its metadata")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise CheckpointError(f"{src.name}: {arch}.{key} is {value!r}, not a (finite) number")
        return kind(value)

    splits = meta.get("split.count", 1)
    if isinstance(splits, int) and splits > 1:
        raise CheckpointError(f"{src.name} is one of {splits} split files; merge them first "
                              "(llama.cpp's llama-gguf-split --merge)")
    if get("expert_count", 0):
        raise CheckpointError(f"{src.name} is a mixture of experts ({arch}.expert_count); not supported")
    if "rope_freqs.weight" in tensor_names:
        raise CheckpointError(f"{src.name} has rope_freqs.weight (Llama 3.1-style rope scaling); not supported")
    layers = get("block_count")
    if not 0 < layers <= MAX_LAYERS:  # before any list of one entry per layer is built
        raise CheckpointError(f"{src.name}: {arch}.block_count is {layers}, not 1 to {MAX_LAYERS}")
    heads, hidden = get("attention.head_count"), get("embedding_length")
    if heads <= 0:
        raise CheckpointError(f"{src.name}: {arch}.attention.head_count is {heads}")
    head_dim = get("attention.key_length", hidden // heads)
    rope_dim = get("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise CheckpointError(f"{src.name}: rotary dimension {rope_dim} is not head_dim {head_dim} "
                              "(partial rotary embeddings are not supported)")
    if head_dim % 2:
        raise CheckpointError(f"{src.name}: head_dim {head_dim} is odd (rotary embeddings rotate pairs)")
    tokens = meta.get("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"], "model_type": arch,
        "vocab_size": get("vocab_size", len(tokens) if isinstance(tokens, list) else None),
        "hidden_size": hidden, "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads), "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", kind=float),
        "rope_theta": get("rope.freq_base", 10000.0, float),
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names, "hidden_act": "silu", "torch_dtype": "float32",
    }
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor", kind=float)}
    elif scaling != "none":
        raise CheckpointError(f"{src.name}: rope scaling {scaling!r} is not supported (only linear)")
    generation: dict[str, Any] = {}
    for name in ("bos", "eos"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if isinstance(token_id, int):
            config[f"{name}_token_id"] = generation[f"{name}_token_id"] = token_id
    if arch == "gemma3":
        _gemma3(config, generation, get, tokens)
    return config, generation


def _gemma3(config: dict[str, Any], generation: dict[str, Any], get: Any, tokens: Any) -> None:
    """Turn the Llama-shaped config of a ``gemma3`` file into Gemma 3's (the module docstring
    says what the file leaves out and what is assumed)."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    full = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    full.update(config.pop("rope_scaling", {}))
    config.update(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh",
        sliding_window=get("attention.sliding_window"),
        layer_types=[FULL if (i + 1) % GEMMA3_FULL_EVERY == 0 else SLIDING for i in range(layers)],
        rope_parameters={FULL: full, SLIDING: {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE}},
        query_pre_attn_scalar=config["hidden_size"] // heads if layers == 62 else config["head_dim"],
        final_logit_softcapping=get("final_logit_softcapping", 0.0, float) or None,
    )
    if get("attn_logit_softcapping", 0.0, float):
        config["attn_logit_softcapping"] = get("attn_logit_softcapping", kind=float)  # refused by ModelConfig
    del config["hidden_act"]
    if isinstance(tokens, list) and "<end_of_turn>" in tokens and "eos_token_id" in generation:
        generation["eos_token_id"] = [generation["eos_token_id"], tokens.index("<end_of_turn>")]


def _weights(reader: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize

    keep_dtype = {GGMLQuantizationType.F16: torch.float16, GGMLQuantizationType.BF16: torch.bfloat16}
    gemma = config["model_type"] == "gemma3_text"
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, _GEMMA3_LAYER_NAMES if gemma else _LAYER_NAMES)
        try:
            array = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a copy off the mmap
        except (NotImplementedError, ValueError) as exc:
            raise CheckpointError(f"tensor {t.name} ({t.tensor_type.name}) cannot be dequantized: {exc}") from None
        heads = None
        if config["model_type"] == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config["num_attention_heads"]
        elif config["model_type"] == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config["num_key_value_heads"]
        if heads is not None:
            if array.shape[0] != heads * config["head_dim"]:
                raise CheckpointError(f"tensor {t.name} has {array.shape[0]} rows, the metadata implies "
                                      f"{heads} heads x {config['head_dim']}")
            array = unpermute(array, heads)
        if gemma and name.endswith("norm.weight"):
            array -= 1.0  # stored as 1 + w (module docstring)
        weights[name] = torch.from_numpy(array).to(keep_dtype.get(t.tensor_type, torch.float32))
    return weights


def _hf_name(gguf_name: str, layer_names: dict[str, str]) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_NAMES and suffix == "weight":
        return f"{_TOP_NAMES[stem]}.weight"
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m is None or m.group(2) not in layer_names:
        raise CheckpointError(f"tensor {gguf_name} has no place in the engine's layout of this model")
    return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"


def unpermute(rows: Any, num_heads: int) -> Any:
    """Undo llama.cpp's q/k permutation. Its converter turns each head's rows from Hugging Face's
    rotate-half order [x0 .. x(d/2-1) | y0 .. y(d/2-1)] into interleaved pairs [x0 y0 x1 y1 ..]:
    ``w.reshape(heads, 2, d/2, ...).swapaxes(1, 2)``; the inverse views the rows as
    (heads, d/2, 2) and swaps back."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
