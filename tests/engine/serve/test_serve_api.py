"""``kvstore engine --random-model`` as a real process on a real port, driven with the official
``openai`` client (and httpx for raw checks): completions and chat, whole and streamed, n > 1,
stop strings, concurrent clients, greedy parity with LLMEngine.generate, cached tokens of a
second turn, disconnects, bad requests (one never hurts another), null fields, the router
endpoints and /metrics."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from kvstore.engine import SamplingParams
from kvstore.keys import Namespace
from kvstore.layout import DTYPES_BY_NAME, KVLayout
from kvstore.services.engine_server.tokenizer import ByteTokenizer

from serve_helpers import BLOCK, MAX_MODEL_LEN, EngineServer, reference_engine, stream_in_background
from waiting import wait_until

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    srv = EngineServer()
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def reference():  # type: ignore[no-untyped-def]
    llm = reference_engine()
    yield llm
    llm.close()


def greedy(client: Any, prompt: Any, max_tokens: int = 12, **kw: Any) -> Any:
    return client.completions.create(model="random", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw)


def test_models_info_and_namespace(server: EngineServer, reference: Any) -> None:
    client = server.client()
    (model,) = client.models.list().data
    assert model.id == "random"
    info = httpx.get(f"{server.url}/v1/kvstore/info").json()
    assert info["model"] == "random" and info["block_size"] == BLOCK and info["max_model_len"] == MAX_MODEL_LEN
    assert info["tokenizer"] == {"kind": "bytes"}
    assert info["kv_events"] == {"endpoint": None, "replay_endpoint": None, "topic": ""}
    assert len(info["engine_id"]) == 36
    ns = info["namespace"]
    layout = KVLayout(ns["num_layers"], ns["num_kv_heads"], ns["head_dim"], ns["block_size"],
                      DTYPES_BY_NAME[ns["dtype"]], ns["tp_rank"], ns["tp_size"])
    rebuilt = Namespace(ns["model_id"], layout, ns["hash_algo"])
    assert rebuilt == reference.namespace and rebuilt.digest == reference.namespace.digest


def test_greedy_equals_llm_engine_generate(server: EngineServer, reference: Any) -> None:
    client = server.client()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for prompt in (PROMPT, [5, 300, 7, 9, 11, 400, 2]):
        ids = ByteTokenizer().encode(prompt) if isinstance(prompt, str) else prompt
        expect = reference.generate([ids], params)[0]
        got = greedy(client, prompt)
        assert got.choices[0].text == ByteTokenizer().decode(expect.token_ids)
        assert got.choices[0].finish_reason == "length"
        assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 12


def test_stream_matches_whole_and_reports_usage(server: EngineServer) -> None:
    client = server.client()
    whole = greedy(client, PROMPT + " stream")
    chunks = list(greedy(client, PROMPT + " stream", stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(greedy(client, PROMPT + " stream", stream=True))
    assert all(c.usage is None for c in plain) and "".join(c.choices[0].text for c in plain) == whole.choices[0].text
    with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": "abc", "max_tokens": 3,
                                                                    "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_chat_whole_and_streamed(server: EngineServer) -> None:
    client = server.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(model="random", messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
    chunks = list(client.chat.completions.create(model="random", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    rendered = "<|system|>\nbe brief\n<|user|>\nhello there\n<|assistant|>\n"
    tokens = httpx.post(f"{server.url}/v1/kvstore/tokenize", json={"messages": messages}).json()["tokens"]
    assert tokens == list(rendered.encode()) and whole.usage.prompt_tokens == len(tokens)
    as_prompt = greedy(client, tokens, max_tokens=10)  # the same ids as a completion: the same reply
    assert as_prompt.choices[0].text == whole.choices[0].message.content


def test_n_samples_and_seed(server: EngineServer) -> None:
    client = server.client()
    kw: dict[str, Any] = dict(model="random", prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=11,
                              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # seed + i per sample
    assert a.usage.completion_tokens == 24
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in a.choices]
    two = client.completions.create(model="random", prompt=[PROMPT, "another prompt"], max_tokens=6, temperature=0,
                                    n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[2].text == greedy(client, "another prompt", max_tokens=6).choices[0].text


def test_stop_strings(server: EngineServer) -> None:
    client = server.client()
    full = greedy(client, PROMPT + " stop", max_tokens=24).choices[0].text
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    cut = full.find(stop)
    got = greedy(client, PROMPT + " stop", max_tokens=24, stop=[stop, "never-appears"])
    assert got.choices[0].text == full[:cut] and got.choices[0].finish_reason == "stop"
    streamed = list(greedy(client, PROMPT + " stop", max_tokens=24, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == full[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"
    server.wait_idle()  # the stopped request was aborted in the engine, not run to max_tokens


def test_a_sample_that_hits_a_stop_string_is_freed_while_its_sibling_runs(server: EngineServer) -> None:
    server.wait_idle()
    body: dict[str, Any] = {"prompt": PROMPT + " samples", "max_tokens": 400, "temperature": 1.0, "seed": 7, "n": 2,
                            "ignore_eos": True}
    first, second = (c["text"] for c in httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
                     .json()["choices"])
    stop = next(first[i : i + 3] for i in range(len(first) - 3)
                if "\ufffd" not in first[i : i + 3] and first[i : i + 3] not in second)
    assert first.find(stop) < 100  # sample 0 stops early; sample 1 has hundreds of tokens to go
    texts = {0: "", 1: ""}
    stopped, finished = threading.Event(), threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stop": stop, "stream": True},
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    (choice,) = json.loads(line.removeprefix("data: "))["choices"]
                    texts[choice["index"]] += choice["text"]
                    if choice["finish_reason"] is not None:
                        (stopped if choice["index"] == 0 else finished).set()

    t = threading.Thread(target=stream)
    t.start()
    assert stopped.wait(30)
    running: list[int] = []

    def one_left_or_done() -> bool:
        running.append(server.load()["running"])
        return running[-1] == 1 or finished.is_set()

    wait_until(one_left_or_done, 60, lambda: f"one sample running, or both done: {running}", poll_s=0.01)
    freed_early = not finished.is_set()
    t.join(60)
    assert freed_early, f"sample 0 stopped, yet the engine ran both samples until the end: {running}"
    assert texts[0] == first[: first.find(stop)] and finished.is_set()


def test_concurrent_clients(server: EngineServer) -> None:
    prompts = [f"client {i} asks something" for i in range(8)]
    alone = [greedy(server.client(), p, max_tokens=8).choices[0].text for p in prompts]
    results: dict[int, str] = {}

    def one(i: int) -> None:
        results[i] = greedy(server.client(), prompts[i], max_tokens=8).choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(8)] == alone


def test_second_turn_reports_cached_tokens(server: EngineServer) -> None:
    client = server.client()
    turn1 = [{"role": "user", "content": "Tell me about paged attention and block tables, please."}]
    r1 = client.chat.completions.create(model="random", messages=turn1, max_tokens=8, temperature=0)
    turn2 = [*turn1, {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And what about prefix caching?"}]
    r2 = client.chat.completions.create(model="random", messages=turn2, max_tokens=8, temperature=0)
    full_blocks = r1.usage.prompt_tokens // BLOCK * BLOCK
    assert r2.usage.prompt_tokens_details.cached_tokens >= full_blocks > 0
    tiers = r2.usage.kvstore["cached_tokens"]
    assert set(tiers) == {"device", "host", "disk", "remote"}
    assert sum(tiers.values()) == r2.usage.prompt_tokens_details.cached_tokens
    assert r2.usage.kvstore["computed_tokens"] == r2.usage.prompt_tokens - sum(tiers.values())


def test_disconnect_mid_stream_frees_the_request(server: EngineServer) -> None:
    server.wait_idle()
    body = {"prompt": PROMPT + " long", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.load()["running"] == 1
    load = server.wait_idle(10)  # far sooner than 400 decode steps would take
    assert load["kv_usage"] == 0.0  # no request holds a block; its prefix stays cached
    with pytest.raises(httpx.ReadTimeout):  # a whole (non-streamed) request whose client gives up
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False, "n": 16}, timeout=0.3)
    server.wait_idle(10)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'kvstore_engine_requests_total{endpoint="completion",status="499"}' in metrics


BAD = [
    ({"prompt": "x" * (MAX_MODEL_LEN + 1)}, 400, "prompt"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "echo": True}, 400, "echo"),
    ({"prompt": "hi", "logprobs": 1}, 400, "logprobs"),
    ({"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ({"prompt": "hi", "seed": -(2**63) - 1}, 400, "seed"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ({}, 400, "prompt"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server: EngineServer) -> None:
    for body, status, param in BAD:
        r = httpx.post(f"{server.url}/v1/completions", json=body)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert error["param"] == param, (body, error)
    for raw in (b"{not json", b"[1, 2]"):
        r = httpx.post(f"{server.url}/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert httpx.get(f"{server.url}/v1/nope").status_code == 404
    with pytest.raises(openai.BadRequestError) as exc:
        server.client().completions.create(model="random", prompt="hi", max_tokens=0)
    assert "max_tokens" in str(exc.value)
    assert greedy(server.client(), "still serving", max_tokens=3).usage.completion_tokens == 3


def test_invalid_unicode_is_a_400_naming_the_param(server: EngineServer) -> None:
    # JSON can carry a lone surrogate ("\\ud800"), which no tokenizer can encode
    for path, raw, param in (
        ("/v1/completions", b'{"prompt": "a\\ud800", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
        ("/v1/kvstore/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        ("/v1/kvstore/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ):
        r = httpx.post(f"{server.url}{path}", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, raw, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
        assert "lone surrogate U+D" in error["message"], error
    assert "Traceback" not in server.output


def test_null_means_the_default(server: EngineServer) -> None:
    client = server.client()
    chat = client.chat.completions.create(model="random", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=None, top_p=None, n=None, stream=None,
                                          stop=None, seed=None, presence_penalty=None, frequency_penalty=None,
                                          user=None, stream_options=None, logprobs=None)
    assert len(chat.choices) == 1 and chat.usage.completion_tokens <= 4
    nulls = dict.fromkeys(("temperature", "top_p", "n", "stream", "stop", "seed", "presence_penalty",
                           "frequency_penalty", "user", "stream_options", "model", "top_k", "ignore_eos",
                           "echo", "logprobs", "suffix", "logit_bias"))
    body = {"prompt": PROMPT, "seed": 5}
    with_nulls = httpx.post(f"{server.url}/v1/completions", json={**nulls, **body, "max_tokens": None}).json()
    defaults = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 16, "temperature": 1.0,
                                                                 "top_p": 1.0, "n": 1}).json()
    assert [c["text"] for c in with_nulls["choices"]] == [c["text"] for c in defaults["choices"]]
    assert with_nulls["usage"] == defaults["usage"]  # max_tokens null is completions' 16 (or an EOS before)
    streamed = httpx.post(f"{server.url}/v1/completions",
                          json={"prompt": "hi", "max_tokens": 2, "stream": True,
                                "stream_options": {"include_usage": None}})
    assert streamed.text.endswith("data: [DONE]\n\n") and '"usage":null' not in streamed.text


def test_an_out_of_range_seed_is_refused_and_hurts_no_one(server: EngineServer) -> None:
    """Sample i of n draws from seed + i modulo 2**64, so no accepted seed overflows inside a
    step (which would abort every request then running); a seed torch cannot take is a 400."""
    victim = {"prompt": PROMPT + " victim", "max_tokens": 250, "temperature": 0, "ignore_eos": True,
              "stream": True, "stream_options": {"include_usage": True}}
    t, events = stream_in_background(server.url, victim)
    client = server.client()
    top = client.completions.create(model="random", prompt=PROMPT, max_tokens=8, seed=2**64 - 1, n=2,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in top.choices] == [0, 1]
    for seed in (2**64, -(2**63) - 1):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "seed": seed, "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    tiny = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 1e-300,
                                                                    "ignore_eos": True})
    assert tiny.status_code == 200, tiny.text  # the argmax, never nan probabilities inside a step
    t.join(60)
    assert not any('"error"' in e for e in events), events[-2:]
    usage = json.loads(events[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 250 and events[-1] == "data: [DONE]"
    # the seed wraps: sample 1 of seed 2**64 - 1 is sample 0 of seed 0
    zero = client.completions.create(model="random", prompt=PROMPT, max_tokens=8, seed=0,
                                     extra_body={"ignore_eos": True})
    assert top.choices[1].text == zero.choices[0].text
    assert tiny.json()["choices"][0]["text"] == greedy(client, "hi", max_tokens=3).choices[0].text


def test_tokenize_and_load_endpoints(server: EngineServer) -> None:
    r = httpx.post(f"{server.url}/v1/kvstore/tokenize", json={"prompt": "héllo"})
    assert r.json() == {"tokens": list("héllo".encode())}
    assert httpx.post(f"{server.url}/v1/kvstore/tokenize", json={"prompt": [3, 4]}).json() == {"tokens": [3, 4]}
    assert httpx.post(f"{server.url}/v1/kvstore/tokenize", json={}).status_code == 400
    # the ids the engine would run, so ids it would refuse are refused as completions refuse them
    for body in ({"prompt": [99999, -5]}, {"prompt": []}, {"prompt": ""}, {"prompt": "x" * (MAX_MODEL_LEN + 1)}):
        r = httpx.post(f"{server.url}/v1/kvstore/tokenize", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (body, r.text)
    load = server.wait_idle()
    assert set(load) == {"running", "waiting", "loading", "queued_prefill_tokens", "running_decode_seqs",
                         "kv_usage", "num_free_blocks"}
    assert load["queued_prefill_tokens"] == 0 and load["running_decode_seqs"] == 0


def test_metrics(server: EngineServer) -> None:
    client = server.client()
    greedy(client, PROMPT + " metrics", max_tokens=4)
    greedy(client, PROMPT + " metrics", max_tokens=4)  # the prompt's full blocks are now device hits
    text = httpx.get(f"{server.url}/metrics").text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values['kvstore_engine_requests_total{endpoint="completion",status="200"}'] >= 2
    assert values["kvstore_engine_time_to_first_token_seconds_count"] >= 2
    assert values["kvstore_engine_inter_token_latency_seconds_count"] >= 6
    assert values['kvstore_engine_cached_prompt_tokens_total{tier="device"}'] >= len(PROMPT + " metrics") // BLOCK
    assert values["kvstore_engine_prompt_tokens_total"] >= 2 * len(PROMPT + " metrics")
    for name in ('kvstore_engine_sequences{state="running"}', "kvstore_engine_device_kv_usage",
                 "kvstore_engine_fetched_blocks_total", "kvstore_engine_fetch_fallback_blocks_total"):
        assert name in values, name


def test_json_is_exactly_openai_shaped(server: EngineServer) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "abc", "max_tokens": 2}).json()
    assert set(r) == {"id", "object", "created", "model", "choices", "usage"} and r["id"].startswith("cmpl-")
    assert set(r["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
    chat = httpx.post(f"{server.url}/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                            "max_completion_tokens": 2}).json()
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 2
    assert json.loads(json.dumps(chat)) == chat and time.time() - chat["created"] < 600
