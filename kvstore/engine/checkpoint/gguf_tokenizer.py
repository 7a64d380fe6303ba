"""A GGUF file's tokenizer, rebuilt as a ``tokenizers.Tokenizer`` from its metadata (llama.cpp
keeps no tokenizer.json, only the vocabulary, the merges or scores, and the special token ids).

Two vocabularies, by ``tokenizer.ggml.model``:

- ``gpt2``: byte-level BPE with the file's merges. Text is split first as llama.cpp splits it
  for ``tokenizer.ggml.pre`` (SmolLM's ``smollm``: every digit alone, then GPT-2's pattern).
- ``llama``: sentencepiece BPE (Llama 1/2, TinyLlama): merges recovered from the token scores,
  byte fallback through the ``<0xNN>`` tokens, a ``▁`` prefix unless ``add_space_prefix`` is false.
  Gemma's files (``general.architecture`` gemma3) need two things more: their scores do not rank
  the merges (the tokens' order in the file does, best first), and their tokens of two or more
  spaces are spelled with spaces rather than ``▁`` (respelled here, so merges reach them).

Tokens the file marks as control (``<|im_start|>``) become special added tokens, user-defined
ones plain added tokens, so that text never cuts them apart. BOS is prepended to plain prompts
when ``tokenizer.ggml.add_bos_token`` says so (sentencepiece vocabularies default to yes).
"""

from __future__ import annotations

import logging
from typing import Any

from kvstore.engine.checkpoint.types import CheckpointError, need_tokenizers

log = logging.getLogger("kvstore.engine")

TOKENIZER_MODELS = ("gpt2", "llama")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regexes llama.cpp splits with, in order (llama-vocab.cpp)
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("gpt-2", "gpt2", "default", "mpt", "olmo", "jais"), (_GPT2_SPLIT,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    (r"\p{N}", _GPT2_SPLIT)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"),
                    (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), (_QWEN2_SPLIT,)),
}


# The chat template a gemma3 GGUF without one gets (its files carry none): turns between
# <start_of_turn>ROLE and <end_of_turn>, the assistant's role named "model"; Gemma has no system
# turn, so a system message opens the first user turn, a blank line after it.
GEMMA3_CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- set ns = namespace(prefix='') -%}\n"
    "{%- for m in messages -%}\n"
    "{%- if m['role'] == 'system' -%}\n"
    "{%- set ns.prefix = ns.prefix ~ (m['content'] | trim) ~ '\\n\\n' -%}\n"
    "{%- else -%}\n"
    "{{- '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else m['role']) ~ '\\n' -}}\n"
    "{{- ns.prefix ~ (m['content'] | trim) ~ '<end_of_turn>\\n' -}}\n"
    "{%- set ns.prefix = '' -%}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}\n"
)


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """The ``tokenizers.Tokenizer`` that the metadata describes.

    Args:
        meta: the GGUF metadata, key -> value (``tokenizer.ggml.tokens`` a list of str, ...).

    Raises:
        CheckpointError: no vocabulary, a tokenizer model other than gpt2 and llama, or no
            ``tokenizers`` package; tokens, token types, merges or scores that are not lists of
            their kind, a merge naming a token the vocabulary lacks, a BOS token the
            tokenizers library cannot template.
    """
    need_tokenizers()
    from tokenizers import AddedToken, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError("the GGUF has no tokenizer.ggml.tokens (no vocabulary)")
    if not all(isinstance(t, str) for t in tokens):
        raise CheckpointError(f"the GGUF's tokenizer.ggml.tokens holds {len(tokens)} values, not all strings")
    types = meta.get("tokenizer.ggml.token_type") or []
    if not isinstance(types, list):
        raise CheckpointError(f"the GGUF's tokenizer.ggml.token_type is a {type(types).__name__}, not a list")
    if kind == "gpt2":
        tokenizer, tokens = _byte_level(meta, tokens), _byte_spelled(tokens)
    elif kind == "llama":
        spelled = tokens
        if meta.get("general.architecture") == "gemma3":  # (the added tokens below keep the file's spelling)
            spelled = [t if t.strip() or " " not in t else "▁" * len(t) for t in tokens]
        tokenizer = _sentencepiece(meta, spelled)
    else:
        raise CheckpointError(f"tokenizer.ggml.model {kind!r} is not supported; supported: {list(TOKENIZER_MODELS)}")
    vocab = tokenizer.get_vocab()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind_ in zip(tokens, types, strict=False) if kind_ == CONTROL and t in vocab])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind_ in zip(tokens, types, strict=False) if kind_ == USER_DEFINED and t in vocab])
    bos = special_token(meta, "bos")
    if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        if bos.startswith("$"):  # a template piece "$A", "$B", "$1" is a sequence, not a token
            raise CheckpointError(f"the GGUF's BOS token {bos!r:.40} starts with '$': the tokenizers library "
                                  "cannot prepend it (its template reads it as a sequence)")
        try:  # a piece "X:N" is read as token X of type N: a BOS token ":" or "a:b" is no piece
            tokenizer.post_processor = processors.TemplateProcessing(
                single=[bos, "$A"], pair=[bos, "$A", bos, "$B"],
                special_tokens=[(bos, int(meta["tokenizer.ggml.bos_token_id"]))])
        except ValueError as exc:
            raise CheckpointError(f"the GGUF's BOS token {bos!r:.40} cannot be prepended by the tokenizers "
                                  f"library's template: {exc}") from None
    return tokenizer


def special_token(meta: dict[str, Any], name: str, tokens: list[str] | None = None) -> str | None:
    """The text of special token ``name`` (bos, eos, unknown, padding), None if the file names none;
    in ``tokens`` (the vocabulary as respelled) when given, else as the file spells it."""
    token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
    tokens = meta["tokenizer.ggml.tokens"] if tokens is None else tokens
    return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None


def _byte_spelled(tokens: list[str]) -> list[str]:
    """Tokens in GPT-2's byte alphabet (llama.cpp writes them so; the odd one is re-spelled)."""
    alphabet = _bytes_to_unicode()
    letters = set(alphabet.values())
    return [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]


def _byte_level(meta: dict[str, Any], tokens: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise CheckpointError("the GGUF's gpt2 tokenizer has no tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(_byte_spelled(tokens))}
    pairs = _merge_pairs(merges, vocab)
    tokenizer = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    splits = PRE_TOKENIZER_SPLITS.get(pre) if isinstance(pre, str) else None
    if splits is None:
        log.warning("tokenizer.ggml.pre %r is unknown; splitting text as GPT-2 does (known: %s)",
                    pre, sorted(PRE_TOKENIZER_SPLITS))
        splits = (_GPT2_SPLIT,)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(meta: dict[str, Any], tokens: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens) \
            or not all(isinstance(s, (int, float)) for s in scores):
        raise CheckpointError("the GGUF's llama (sentencepiece) tokenizer has no tokenizer.ggml.scores "
                              f"for its {len(tokens)} tokens (one number each)")
    vocab = {t: i for i, t in enumerate(tokens)}
    if meta.get("general.architecture") == "gemma3":  # ranked by their order in the file, not by score
        scores = [-float(i) for i in range(len(tokens))]
    merges = meta.get("tokenizer.ggml.merges")
    pairs = (_merge_pairs(merges, vocab) if isinstance(merges, list)
             else _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True))))
    unk = special_token(meta, "unknown", tokens)  # a token of the model's vocabulary: respelled
    tokenizer = Tokenizer(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                       split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tokenizer


def _merge_pairs(merges: list[Any], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """``"LEFT RIGHT"`` -> (LEFT, RIGHT); CheckpointError for a merge that is not two tokens of
    ``vocab`` whose concatenation is one too (the tokenizers library refuses it with a plain
    Exception)."""
    pairs = []
    for i, merge in enumerate(merges):
        left, space, right = merge.partition(" ") if isinstance(merge, str) else ("", "", "")
        if not space or left not in vocab or right not in vocab or left + right not in vocab:
            raise CheckpointError(f"the GGUF's tokenizer.ggml.merges[{i}] is {merge!r:.60}, not two tokens of its "
                                  "vocabulary (separated by a space) whose concatenation is one too")
        pairs.append((left, right))
    return pairs


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Sentencepiece keeps no merges: every split of a token into two known tokens is one,
    ranked by the merged token's score, best first (as transformers' ``generate_merges``)."""
    found = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells every token in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
