"""A GGUF's tokenizer rebuilt from its metadata (``build_tokenizer``, run on every GGUF the
engine converts): the vocabulary, its token types, the merges or the scores, the BOS/EOS/UNK
ids, ``tokenizer.ggml.pre`` and the flags.

Input: the metadata as a JSON object, key -> value, as the GGUF reader hands it over (a
string, a number, a bool, or a list of them); ``general.architecture`` picks Gemma's rules.
An input that does not open with ``{`` is drawn into metadata by atheris's
FuzzedDataProvider instead (``_drawn``: a small vocabulary of short tokens, merges and ids
among them, sometimes every byte spelled, each field sometimes absent or of another type).
What must hold:

- bad metadata (no vocabulary, tokens that are not strings, a merge naming a token the
  vocabulary lacks, scores that are not one number per token, ...) is refused with
  CheckpointError, never another error of Python or of the tokenizers library;
- a tokenizer it builds encodes text into ids below the file's number of tokens (its
  embedding's rows), and decodes them; where the vocabulary spells every byte (GPT-2's 256
  byte characters, or sentencepiece's 256 ``<0xNN>`` tokens and ``▁``) and the encoding
  holds no added token but a BOS in front that the vocabulary marks control, the text
  decodes back to itself (but a leading space under sentencepiece's prefix, which the
  decoder strips as transformers' does).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from kvstore.engine.checkpoint.gguf_tokenizer import _bytes_to_unicode, build_tokenizer
from kvstore.engine.checkpoint.types import CheckpointError

TEXTS = ("Hello world, 12 apples!\n  two spaces\tand a tab", " Grüße 🙂 ok", "a")
BYTE_CHARS = frozenset(_bytes_to_unicode().values())
BYTE_TOKENS = frozenset(f"<0x{b:02X}>" for b in range(256))


def _decodes_back(meta: dict[str, Any], tokenizer: Any, encoding: Any, text: str) -> bool:
    """Whether ``text`` must decode to itself (the module docstring): control tokens are
    skipped by decoding, and a user-defined one is matched in the text as the file spells it."""
    kind = meta.get("tokenizer.ggml.model")
    # sentencepiece spells a space "▁": without that token it falls back to its bytes, which
    # decode as "▁" (transformers' decoder replaces "▁" before it joins bytes)
    if not set(meta["tokenizer.ggml.tokens"]) >= (BYTE_CHARS if kind == "gpt2" else {*BYTE_TOKENS, "▁"}):
        return False
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    if kind == "llama" and ("▁" in text or (text.startswith(" ") and prefix)):
        return False  # "▁" decodes as a space; no prefix is added before a leading space, and one is stripped
    added = tokenizer.get_added_tokens_decoder()
    for i, framing in zip(encoding.ids, encoding.special_tokens_mask, strict=True):
        special = i in added and added[i].special  # skipped by decoding
        if (framing and not special) or (not framing and i in added):
            return False
    return True


def _drawn(data: bytes) -> dict[str, Any]:
    """Metadata drawn from ``data`` (the module docstring)."""
    import atheris

    fdp = atheris.FuzzedDataProvider(data)
    model = fdp.PickValueInList(["gpt2", "llama", "bert"])
    tokens = [fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 3)) for _ in range(fdp.ConsumeIntInRange(1, 16))]
    if fdp.ConsumeBool():
        tokens += sorted(BYTE_CHARS if model == "gpt2" else BYTE_TOKENS)
    merges = []
    for _ in range(fdp.ConsumeIntInRange(0, 8)):
        left, right = (tokens[fdp.ConsumeIntInRange(0, len(tokens) - 1)] for _ in range(2))
        merges.append(f"{left} {right}")
        if fdp.ConsumeBool():
            tokens.append(left + right)
    meta: dict[str, Any] = {
        "general.architecture": fdp.PickValueInList(["llama", "gemma3", "qwen2"]),
        "tokenizer.ggml.model": model,
        "tokenizer.ggml.pre": fdp.PickValueInList(["smollm", "llama-bpe", "qwen2", "default", "unknown"]),
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [fdp.ConsumeIntInRange(0, 6) for _ in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.scores": [fdp.ConsumeRegularFloat() for _ in tokens],
        "tokenizer.ggml.add_bos_token": fdp.ConsumeBool(),
        "tokenizer.ggml.add_space_prefix": fdp.ConsumeBool(),
        **{f"tokenizer.ggml.{name}_token_id": fdp.ConsumeIntInRange(-1, len(tokens))
           for name in ("bos", "eos", "unknown", "padding")},
    }
    for key in list(meta):
        fate = fdp.ConsumeIntInRange(0, 15)
        if fate == 0:
            del meta[key]
        elif fate == 1:  # another type: a scalar where a list goes, a list of the wrong kind
            meta[key] = fdp.PickValueInList([7, 1.5, True, "x", [], [1, 2], ["a", "b"], [[1]], [None]])
    return meta


def make() -> Callable[[bytes], None]:
    logging.getLogger("kvstore.engine").setLevel(logging.ERROR)  # an unknown tokenizer.ggml.pre warns

    def check(data: bytes) -> None:
        if data[:1] == b"{":
            try:
                meta = json.loads(data)
            except (ValueError, RecursionError):
                return
            if not isinstance(meta, dict):
                return
        else:
            meta = _drawn(data)
        try:
            tokenizer = build_tokenizer(meta)
        except CheckpointError:
            return
        size = len(meta["tokenizer.ggml.tokens"])  # the embedding's rows (a duplicate token leaves a hole)
        for text in TEXTS:
            encoding = tokenizer.encode(text)
            ids = encoding.ids
            assert all(0 <= i < size for i in ids), f"ids {ids} outside the vocabulary of {size}"
            back = tokenizer.decode(ids)
            if _decodes_back(meta, tokenizer, encoding, text):
                assert back == text, f"{text!r} decodes back as {back!r} (ids {ids})"

    return check


# --- seeds ------------------------------------------------------------------------------------

def _smollm2(keep_tokens: int = 600) -> dict[str, Any] | None:
    """SmolLM2's real tokenizer metadata (byte-level BPE, ``smollm`` pre-tokenizer), its
    vocabulary cut to the first ``keep_tokens`` tokens and the merges among them."""
    import gguf

    from kvstore.engine.checkpoint.bundled import smollm2_gguf

    real = smollm2_gguf()
    if real is None:
        return None
    reader = gguf.GGUFReader(real)
    meta = {name: field.contents() for name, field in reader.fields.items()
            if name.startswith("tokenizer.ggml.") or name == "general.architecture"}
    tokens = meta["tokenizer.ggml.tokens"][:keep_tokens]
    known = set(tokens)
    meta["tokenizer.ggml.merges"] = [m for m in meta["tokenizer.ggml.merges"]
                                     if all(p in known for p in m.split(" ", 1)) and m.replace(" ", "", 1) in known]
    meta["tokenizer.ggml.tokens"] = tokens
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"][:keep_tokens]
    return meta


def _gemma3() -> dict[str, Any]:
    """Gemma 3's shape: sentencepiece with byte fallback, spaces spelled as spaces, scores that
    do not rank the merges (as tests/engine/test_gguf_gemma3_inputs.py writes one)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["▁", "a", "b", "c", "h", "e", "l", "o", "u", "s", "r", "ab", "bc", "he", "ll", "llo", "▁he",
              "▁hello", "us", "er", "▁us", "▁user"]
    tokens = [*specials, "\n", "  ", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    return {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [-1000.0] * (len(specials) + 2 + 256) + [float(i) for i in range(len(pieces))],
            "tokenizer.ggml.token_type": [3] * len(specials) + [4, 4] + [6] * 256 + [1] * len(pieces),
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False}


def _llama_spm() -> dict[str, Any]:
    """Llama 1/2 (TinyLlama) shape: sentencepiece, merges recovered from the scores, a prefix."""
    pieces = ["▁", "a", "e", "h", "l", "o", "t", "w", "r", "d", "he", "ll", "▁t", "▁the", "llo", "▁w", "or",
              "▁wor", "▁world", "▁he", "▁hello", "ld"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    return {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))],
            "tokenizer.ggml.token_type": [2, 3, 3, *[6] * 256, *[1] * len(pieces)],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}


def _gpt2_llama3() -> dict[str, Any]:
    """A byte-level BPE with Llama 3's pre-tokenizer, every byte spelled, a few merges."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tokens = [*sorted(BYTE_CHARS), "He", "ll", "Ġw", "or", "Hell", "Ġwor", "ld", *specials]
    return {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * (len(tokens) - 2) + [3, 3],
            "tokenizer.ggml.merges": ["H e", "l l", "Ġ w", "o r", "He ll", "Ġw or", "l d"],
            "tokenizer.ggml.bos_token_id": len(tokens) - 2, "tokenizer.ggml.eos_token_id": len(tokens) - 1,
            "tokenizer.ggml.add_bos_token": True}


def seeds() -> dict[str, bytes]:
    out = {"gemma3-spm": _gemma3(), "llama-spm-scores": _llama_spm(), "gpt2-llama-bpe": _gpt2_llama3()}
    smollm2 = _smollm2()
    if smollm2 is not None:
        out["smollm2-gpt2-600-tokens"] = smollm2
    return {name: json.dumps(meta, ensure_ascii=False).encode() for name, meta in out.items()}
