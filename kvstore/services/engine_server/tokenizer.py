"""The server's text side: a tokenizer (the checkpoint's, or bytes for the random model) and
the chat template that turns messages into one prompt string.

``ByteTokenizer`` (the random model, which has no tokenizer.json): token id = one UTF-8 byte,
0..255; ids 256 and up (the random model's vocabulary is larger) decode to nothing, and text
that is not valid UTF-8 decodes with U+FFFD. ``HFTokenizer``: the checkpoint's tokenizer.json
(via ``tokenizers``), its ``bos_token`` and ``eos_token`` from tokenizer_config.json, and its chat
template from the first of ``CHAT_TEMPLATE_SOURCES`` that has one. A GGUF model is read from its
converted copy, which holds the GGUF's tokenizer and template in those files.

Without a chat template, ``PLAIN_TEMPLATE`` is used (docs/serving.md): by design for the random
model; for a checkpoint, ``load_tokenizer`` logs a warning at start, naming the files it looked in.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("kvstore.services.engine_server")

# Where checkpoints keep their chat template, first match wins: transformers 5's save_pretrained
# writes chat_template.jinja (and leaves tokenizer_config.json without one); processors of
# transformers 4.4x wrote chat_template.json; older tokenizers keep it in tokenizer_config.json.
CHAT_TEMPLATE_SOURCES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")

# Each message as "<|role|>\n" + content + "\n", then "<|assistant|>\n" to prompt the reply.
# Turn k's prompt is a prefix of turn k+1's, so a conversation's earlier turns are cache hits.
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ServeTokenizer:
    """Text <-> token ids plus the chat template; every method is safe from any thread."""

    kind = "none"
    chat_template: str | None = None  # the checkpoint's; None: PLAIN_TEMPLATE
    bos_token: str | None = None
    eos_token: str | None = None

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``.

        Raises:
            ValueError: ``text`` is not valid Unicode (a lone surrogate, which JSON can carry).
        """
        raise NotImplementedError

    def decode(self, token_ids: Sequence[int]) -> str:
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        """What a router needs to tokenize exactly as this server does (docs/serving.md)."""
        return {"kind": self.kind}

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt ids of a conversation: the template rendered with a generation prompt."""
        return self.encode_rendered(render_chat(self.chat_template or PLAIN_TEMPLATE, messages,
                                                self.bos_token, self.eos_token))

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of a rendered chat prompt (a template writes its own special tokens)."""
        return self.encode(text)


class ByteTokenizer(ServeTokenizer):
    kind = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(utf8(text))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", "replace")


class HFTokenizer(ServeTokenizer):
    """A checkpoint's tokenizer.json; plain prompts get its special tokens (BOS), as the engine's."""

    kind = "hf"
    chat_template_source: Path | None = None  # the file the template came from

    def __init__(self, model_dir: str | Path, tokenizer: Any) -> None:
        self.path = (Path(model_dir) / "tokenizer.json").resolve()
        self.tokenizer = tokenizer
        config = _read_json(Path(model_dir) / "tokenizer_config.json") or {}
        self.chat_template, self.chat_template_source = find_chat_template(model_dir)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))

    def encode(self, text: str) -> list[int]:
        utf8(text)
        return list(self.tokenizer.encode(text).ids)

    def encode_rendered(self, text: str) -> list[int]:
        utf8(text)
        return list(self.tokenizer.encode(text, add_special_tokens=self.chat_template is None).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids)))

    def info(self) -> dict[str, Any]:
        return {"kind": "hf", "path": str(self.path), "chat_template": self.chat_template,
                "bos_token": self.bos_token, "eos_token": self.eos_token}


def utf8(text: str) -> bytes:
    """``text`` as UTF-8; ValueError naming the first lone surrogate (a JSON ``"\\ud800"``)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text is not valid Unicode: a lone surrogate U+{ord(text[exc.start]):04X} "
                         f"at character {exc.start}") from None


def find_chat_template(model_dir: str | Path) -> tuple[str | None, Path | None]:
    """A checkpoint directory's chat template and the file it came from, (None, None) if it has
    none; see ``CHAT_TEMPLATE_SOURCES``.

    Raises:
        ValueError: a file that should hold the template cannot be read or parsed.
    """
    for name in CHAT_TEMPLATE_SOURCES:
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        if name.endswith(".jinja"):
            try:
                template: Any = path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read {path}: {exc}") from None
        else:
            template = (_read_json(path) or {}).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str) and template.strip():
            return template, path.resolve()
    return None, None


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(model: str | Path | None, engine_tokenizer: Any) -> ServeTokenizer:
    """The tokenizer of a served engine: the checkpoint's, or bytes for the random model.

    Args:
        model: the engine's model: a checkpoint directory, a GGUF file (read from its converted
            copy, which the engine has built), or None for the random model.
        engine_tokenizer: the engine's ``tokenizers.Tokenizer`` (None: the checkpoint has none).

    Raises:
        ValueError: the checkpoint has no tokenizer, or a tokenizer or template file is unreadable.
    """
    if model is None:
        return ByteTokenizer()
    from kvstore.engine.checkpoint import checkpoint_dir

    model_dir = checkpoint_dir(model)
    if engine_tokenizer is None:
        raise ValueError(f"{model} has no tokenizer (tokenizer.json); the server needs one for text prompts")
    tokenizer = HFTokenizer(model_dir, engine_tokenizer)
    if tokenizer.chat_template is None:
        log.warning("%s has no chat template (looked in %s); /v1/chat/completions renders messages with "
                    "the plain template (<|role|> lines, docs/serving.md), which a chat model was not "
                    "trained on", model, ", ".join(CHAT_TEMPLATE_SOURCES))
    else:
        log.info("chat template of %s: %s", model, tokenizer.chat_template_source)
    return tokenizer


_templates: dict[str, Any] = {}


def render_chat(template: str, messages: list[dict[str, str]], bos_token: str | None,
                eos_token: str | None) -> str:
    """Render a Hugging Face-style chat template in a sandbox (templates come from files, but a
    template is code: the sandbox keeps it from reaching Python internals).

    Raises:
        ValueError: the template fails to compile or raises (e.g. a role order it refuses).
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    compiled = _templates.get(template)
    if compiled is None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
        try:
            compiled = env.from_string(template)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from None
        _templates[template] = compiled
    try:
        return str(compiled.render(messages=messages, add_generation_prompt=True, bos_token=bos_token or "",
                                   eos_token=eos_token or ""))
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template failed: {exc}") from None


def _raise(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)
