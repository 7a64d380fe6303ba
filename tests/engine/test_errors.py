"""Bad input gets a clear error, and the engine keeps serving the requests it already has."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvstore.engine import CheckpointError, LLMEngine, SamplingParams
from kvstore.engine.config import EngineConfig
from kvstore.errors import ConfigError
from tests.engine.conftest import GREEDY, make_engine


def test_bad_requests_are_refused_while_others_keep_running(llama_dir: Path) -> None:
    llm = make_engine(llama_dir, max_model_len=32)
    try:
        good = llm.add_request(list(range(3, 12)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        llm.step()
        with pytest.raises(ValueError, match="empty"):
            llm.add_request([])
        with pytest.raises(ValueError, match=r"outside \[0, 128\)"):
            llm.add_request([1, 2, 128])
        with pytest.raises(ValueError, match=r"outside \[0, 128\)"):
            llm.add_request([-1])
        with pytest.raises(ValueError, match="outside"):
            llm.add_request([1, "2"])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="40 tokens; the model's context is 32"):
            llm.add_request(list(range(40)))
        with pytest.raises(ValueError, match="max_tokens"):
            SamplingParams(max_tokens=0)
        with pytest.raises(ValueError, match="max_tokens"):
            SamplingParams(max_tokens=-3)
        with pytest.raises(ValueError, match="empty"):
            llm.generate([[1, 2, 3], []])  # validated before anything is queued
        assert len(llm.scheduler.waiting) + len(llm.scheduler.running) == 1
        finished = None
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.finished:
                    finished = out
        assert finished is not None and finished.request_id == good and len(finished.token_ids) == 8
        # a prompt close to the context limit stops there
        out = llm.generate(list(range(30)), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
        assert len(out.token_ids) == 2 and out.outputs[0].finish_reason == "length"
    finally:
        llm.close()


def test_prompt_larger_than_the_pool(llama_dir: Path) -> None:
    llm = make_engine(llama_dir, kv_cache_bytes=4 * 2048)
    with pytest.raises(ValueError, match="KV blocks; the device pool has 4"):
        llm.add_request(list(range(20)))
    llm.close()


@pytest.mark.timeout(120)
def test_a_sequence_that_fills_the_pool_stops_with_length(llama_dir: Path) -> None:
    # 4 blocks of 4 tokens: a 10-token prompt may grow to 16 tokens, then it has the whole
    # pool; before, its decode preempted itself and waited for room forever.
    with make_engine(llama_dir, kv_cache_bytes=4 * 2048) as llm:
        long, short = llm.generate([list(range(10)), [7, 8]], SamplingParams(max_tokens=20, ignore_eos=True))
        assert len(long.token_ids) == 6 and long.outputs[0].finish_reason == "length"
        assert len(short.token_ids) == 14 and short.outputs[0].finish_reason == "length"
        llm.check_integrity()


def test_missing_and_malformed_checkpoints(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        LLMEngine(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        LLMEngine(str(empty))

    def variant(name: str) -> Path:
        path = tmp_path / name
        shutil.copytree(llama_dir, path)
        return path

    bad_json = variant("bad-json")
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"cannot read .*config\.json"):
        LLMEngine(str(bad_json))
    gpt = variant("gpt")
    cfg = json.loads((gpt / "config.json").read_text())
    (gpt / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        LLMEngine(str(gpt))
    no_field = variant("no-field")
    (no_field / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}))
    with pytest.raises(CheckpointError, match=r"malformed.*hidden_size"):
        LLMEngine(str(no_field))
    no_weights = variant("no-weights")
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        LLMEngine(str(no_weights))
    truncated = variant("truncated")
    weights = next(truncated.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="cannot read weights"):
        LLMEngine(str(truncated))
    wrong_shape = variant("wrong-shape")
    (wrong_shape / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 4}))
    with pytest.raises(CheckpointError, match="q/k/v weights"):
        LLMEngine(str(wrong_shape))


def test_bad_engine_settings(llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="fetch_policy"):
        make_engine(llama_dir, fetch_policy="sometimes")
    with pytest.raises(ConfigError, match="device_write_policy"):
        make_engine(llama_dir, device_write_policy="write_around")
    with pytest.raises(ConfigError, match="holds no block"):
        make_engine(llama_dir, kv_cache_bytes=100)
    with pytest.raises(ConfigError, match="dtype"):
        make_engine(llama_dir, dtype="float32")
    with pytest.raises(ConfigError, match="daemon address"):
        make_engine(llama_dir, store_url="redis://localhost", host_bytes=0)
    with pytest.raises(ConfigError, match="store_token"):
        make_engine(llama_dir, store_token="s3cret")
    with pytest.raises(OSError):  # nothing listens there
        make_engine(llama_dir, store_url="unix:///nonexistent/kvstore.sock", host_bytes=0)


def test_store_with_an_address_is_the_old_spelling_of_store_url() -> None:
    with pytest.warns(DeprecationWarning, match="spelled store_url=<address> now"):
        config = EngineConfig(store="unix:///tmp/kvstore.sock")  # type: ignore[arg-type]
    assert (config.store, config.store_url) == (None, "unix:///tmp/kvstore.sock")
    with pytest.raises(ConfigError, match="give the daemon address once"), pytest.warns(DeprecationWarning):
        EngineConfig(store="unix:///a.sock", store_url="unix:///b.sock")  # type: ignore[arg-type]
    assert EngineConfig.build(None, host_bytes=0, disk_codec="int8").store_settings.changed_from() == [
        "host_bytes", "disk_codec"]


def test_random_model_runs_without_a_checkpoint() -> None:
    llm = LLMEngine(None, block_size=4, kv_cache_bytes=1 << 20, host_bytes=0,
                    random_model=dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                      vocab_size=100, intermediate_size=96))
    a = llm.generate([1, 2, 3, 4, 5], GREEDY)[0]
    llm.close()
    llm = LLMEngine(None, block_size=4, kv_cache_bytes=1 << 20, host_bytes=0,
                    random_model=dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                      vocab_size=100, intermediate_size=96))
    assert llm.generate([1, 2, 3, 4, 5], GREEDY)[0].token_ids == a.token_ids  # seeded weights
    llm.close()


LLAMA = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize(("config", "named"), [
    ({"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]},
     r"model_type 'qwen3_next': layer 0 is 'linear_attention', a layer kind the engine lacks"),
    ({"model_type": "llama4_text", "layer_types": ["chunked_attention", "full_attention"]},
     r"layer 0 is 'chunked_attention'"),
    ({"model_type": "falcon_h1", "layer_types": ["full_attention", "mamba"]}, r"layer 1 is 'mamba'"),
    ({"model_type": "lfm2", "layer_types": ["conv", "full_attention"]}, r"layer 0 is 'conv'"),
    ({"model_type": "qwen2", "layer_types": ["full_attention", "hybrid"]}, r"model_type 'qwen2': layer 1 is 'hybrid'"),
    ({"model_type": "gpt_oss", "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 128},
     r"model_type 'gpt_oss' is not supported \(attention sinks\)"),
    ({"model_type": "falcon_h1"}, r"model_type 'falcon_h1' is not supported \(Mamba2 layers\)"),
    ({"model_type": "jamba"}, r"model_type 'jamba' is not supported \(Mamba layers\)"),
    ({"model_type": "qwen3_next"}, r"model_type 'qwen3_next' is not supported \(linear attention layers\)"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0},
     r"gemma3_text with attn_logit_softcapping=50\.0 is not supported"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, r"use_bidirectional_attention=True"),
    ({"model_type": "gemma3", "text_config": {}}, r"model_type 'gemma3' is not supported \(a vision tower"),
    ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 8,
      "layer_types": ["sliding_attention", "full_attention"]},
     r"qwen2: layer_types names sliding_attention layers but no sliding_window is set"),
    ({"model_type": "llama", "hidden_act": "gelu"}, r"hidden activation 'gelu' is not supported"),
])
def test_a_layer_kind_or_model_the_engine_lacks_is_a_one_line_error(config: dict[str, object], named: str,
                                                                     llama_dir: Path, tmp_path: Path) -> None:
    """Linear attention, Mamba, chunked attention, attention sinks, ...: refused by name, in one
    line, when config.json is read (before any weight)."""
    path = shutil.copytree(llama_dir, tmp_path / "model")
    (path / "config.json").write_text(json.dumps({**LLAMA, **config}))
    with pytest.raises(CheckpointError, match=named) as caught:
        LLMEngine(str(path))
    assert "\n" not in str(caught.value)
