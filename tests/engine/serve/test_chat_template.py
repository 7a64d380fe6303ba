"""Where the server finds a checkpoint's chat template: ``chat_template.jinja`` (what
transformers 5's ``save_pretrained`` writes), ``chat_template.json``, ``tokenizer_config.json``,
first match wins; without one, the plain template with a warning at start (never silently)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstore.engine.checkpoint import random_checkpoint, save_random_checkpoint
from kvstore.services.engine_server.tokenizer import (
    CHAT_TEMPLATE_SOURCES,
    PLAIN_TEMPLATE,
    HFTokenizer,
    find_chat_template,
    load_tokenizer,
    render_chat,
)

from factories import require
from waiting import wait_serving

TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
OTHER = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
MODEL = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
             vocab_size=128, max_position_embeddings=256)
WORDS = ["<unk>", "<s>", "</s>", "[system]", "[user]", "[assistant]", "<|user|>", "<|assistant|>",
         *[f"w{i}" for i in range(100)]]
MESSAGES = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3"}]


def word_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single=["<s>", "$A"], special_tokens=[("<s>", 1)])
    return tok


def checkpoint(root: Path, files: dict[str, Any]) -> Path:
    """A random-weights checkpoint with the word tokenizer and ``files`` (name -> text or JSON)."""
    save_random_checkpoint(root, random_checkpoint(MODEL, 2))
    word_tokenizer().save(str(root / "tokenizer.json"))
    for name, content in files.items():
        (root / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return root


def ids(text: str) -> list[int]:
    return [WORDS.index(w) for w in text.split()]


@pytest.fixture(scope="module")
def saved_by_transformers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose tokenizer transformers saved (``save_pretrained``), template included."""
    require(importlib.util.find_spec("transformers"), "transformers is not installed (pip extra 'test')")
    import transformers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("hf5") / "tiny-chat"
    save_random_checkpoint(root, random_checkpoint(MODEL, 2))
    tok = PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(), bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", chat_template=TEMPLATE)
    tok.save_pretrained(root)
    if int(transformers.__version__.split(".")[0]) >= 5:  # the layout this issue is about
        assert (root / "chat_template.jinja").read_text() == TEMPLATE
        assert "chat_template" not in json.loads((root / "tokenizer_config.json").read_text())
    return root


def test_a_transformers_saved_template_is_used(saved_by_transformers: Path) -> None:
    from tokenizers import Tokenizer

    served = load_tokenizer(str(saved_by_transformers),
                            Tokenizer.from_file(str(saved_by_transformers / "tokenizer.json")))
    assert isinstance(served, HFTokenizer) and served.chat_template == TEMPLATE
    assert served.bos_token == "<s>" and served.eos_token == "</s>"
    # the template's BOS only (the tokenizer's post-processor would add a second one)
    assert served.encode_chat(MESSAGES) == ids("<s> [system] w1 w2 [user] w3 [assistant]")


@pytest.mark.parametrize(("files", "source", "template"), [
    ({"chat_template.jinja": TEMPLATE, "tokenizer_config.json": {"chat_template": OTHER}}, "chat_template.jinja",
     TEMPLATE),
    ({"chat_template.json": {"chat_template": TEMPLATE}, "tokenizer_config.json": {"chat_template": OTHER}},
     "chat_template.json", TEMPLATE),
    ({"tokenizer_config.json": {"chat_template": [{"name": "tool_use", "template": OTHER},
                                                  {"name": "default", "template": TEMPLATE}]}},
     "tokenizer_config.json", TEMPLATE),
    ({"chat_template.jinja": "  \n", "tokenizer_config.json": {"chat_template": OTHER}}, "tokenizer_config.json",
     OTHER),  # a blank file is no template
])
def test_the_first_source_with_a_template_wins(files: dict[str, Any], source: str, template: str,
                                               tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "m", files)
    assert find_chat_template(root) == (template, (root / source).resolve())


def test_an_unreadable_template_file_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "m", {})
    (root / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ValueError, match=r"cannot read .*chat_template\.jinja"):
        find_chat_template(root)


def test_no_template_is_the_plain_one_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = checkpoint(tmp_path / "base", {"tokenizer_config.json": {"bos_token": "<s>", "eos_token": "</s>"}})
    with caplog.at_level(logging.WARNING, logger="kvstore.engine.serve"):
        served = load_tokenizer(str(root), word_tokenizer())
    assert served.chat_template is None
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "has no chat template" in record.getMessage() and "plain template" in record.getMessage()
    for name in CHAT_TEMPLATE_SOURCES:
        assert name in record.getMessage()
    plain = render_chat(PLAIN_TEMPLATE, [{"role": "user", "content": "w3"}], None, None)
    assert plain == "<|user|>\nw3\n<|assistant|>\n"
    assert served.encode_chat([{"role": "user", "content": "w3"}]) == ids("<s> <|user|> w3 <|assistant|>")


def test_the_random_model_uses_the_plain_template_by_design(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvstore.engine.serve"):
        served = load_tokenizer(None, None)
    assert served.kind == "bytes" and not caplog.records
    assert served.encode_chat([{"role": "user", "content": "hi"}]) == list(b"<|user|>\nhi\n<|assistant|>\n")


@pytest.fixture(scope="module")
def server(saved_by_transformers: Path) -> Iterator[str]:
    """The server as ``kvstore engine --model DIR`` builds it, on a real uvicorn server in a thread."""
    from kvstore.config import StoreSettings
    from kvstore.services.common.http import bind, uvicorn_server, where
    from kvstore.services.engine_server.app import create_app
    from kvstore.services.engine_server.config import EngineServerConfig
    from kvstore.services.engine_server.server import build_state

    state = build_state(EngineServerConfig(model=str(saved_by_transformers), port=0, kv_cache_bytes=1 << 20, block_size=4,
                                    store_settings=StoreSettings(host_bytes=0)))
    sock = bind("127.0.0.1", 0)
    uvicorn = uvicorn_server(create_app(state))
    thread = threading.Thread(target=lambda: asyncio.run(uvicorn.serve(sockets=[sock])), daemon=True)
    thread.start()
    wait_serving(uvicorn, thread)
    yield f"http://{where(sock)}"
    uvicorn.should_exit = True
    thread.join(30)
    state.loop.stop()
    state.loop.llm.close()


def test_the_server_renders_chat_with_the_saved_template(server: str) -> None:
    info = httpx.get(f"{server}/v1/kvstore/info").json()
    assert info["tokenizer"]["chat_template"] == TEMPLATE
    expect = ids("<s> [system] w1 w2 [user] w3 [assistant]")
    assert httpx.post(f"{server}/v1/kvstore/tokenize", json={"messages": MESSAGES}).json()["tokens"] == expect
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "tiny-chat", "messages": MESSAGES,
                                                          "max_tokens": 3, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(expect)
