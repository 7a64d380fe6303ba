"""``kvstore engine --model DIR`` on a Hugging Face-layout checkpoint with a tokenizer.json and
a tokenizer_config.json chat template: text in and out through the checkpoint's tokenizer, the
template applied exactly as /v1/kvstore/tokenize and /v1/kvstore/info say."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kvstore.engine import LLMEngine, SamplingParams
from kvstore.engine.checkpoint import random_checkpoint, save_random_checkpoint

from serve_helpers import EngineServer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant{% endif %}")
MODEL = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
             vocab_size=128, max_position_embeddings=256)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    root = tmp_path_factory.mktemp("ckpt") / "tiny-chat"
    save_random_checkpoint(root, random_checkpoint(MODEL, 4))
    words = ["<unk>", "<s>", "</s>", "user", "assistant", "system", *[f"w{i}" for i in range(100)]]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}}))
    return root, tok


@pytest.fixture(scope="module")
def server(checkpoint: tuple[Path, Any]):  # type: ignore[no-untyped-def]
    srv = EngineServer(model=str(checkpoint[0]))
    yield srv
    srv.kill()


def test_info_names_the_tokenizer_and_template(server: EngineServer, checkpoint: tuple[Path, Any]) -> None:
    info = httpx.get(f"{server.url}/v1/kvstore/info").json()
    assert info["model"] == "tiny-chat" and info["max_model_len"] == 256
    assert info["tokenizer"] == {"kind": "hf", "path": str((checkpoint[0] / "tokenizer.json").resolve()),
                                 "chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}


def test_chat_applies_the_template_once(server: EngineServer, checkpoint: tuple[Path, Any]) -> None:
    root, tok = checkpoint
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 w4 w5"}]
    expect = tok.encode("<s>system w1 w2 user w3 w4 w5 assistant", add_special_tokens=False).ids
    assert expect[0] == 1 and expect.count(1) == 1  # the template's BOS, and only it
    tokens = httpx.post(f"{server.url}/v1/kvstore/tokenize", json={"messages": messages}).json()["tokens"]
    assert tokens == expect
    client = server.client()
    r = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(expect)
    llm = LLMEngine(str(root), block_size=16, host_bytes=0, kv_cache_bytes=4 << 20, dtype=torch.float32)
    try:
        out = llm.generate([expect], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    finally:
        llm.close()
    assert r.choices[0].message.content == tok.decode(out.token_ids)


def test_text_prompts_get_the_tokenizers_bos(server: EngineServer, checkpoint: tuple[Path, Any]) -> None:
    tokens = httpx.post(f"{server.url}/v1/kvstore/tokenize", json={"prompt": "w7 w8 w9"}).json()["tokens"]
    assert tokens == [1, *checkpoint[1].encode("w7 w8 w9", add_special_tokens=False).ids]
    r = server.client().completions.create(model="tiny-chat", prompt="w7 w8 w9", max_tokens=3)
    assert r.usage.prompt_tokens == 4


def test_a_lone_surrogate_is_a_400_not_a_tokenizer_crash(server: EngineServer) -> None:
    for path, raw, param in (("/v1/completions", b'{"prompt": "w1 \\ud800"}', "prompt"),
                             ("/v1/kvstore/tokenize", b'{"prompt": "\\udfff"}', "prompt"),
                             ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                              "messages")):
        r = httpx.post(f"{server.url}{path}", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == param and "lone surrogate" in r.json()["error"]["message"]
