"""A hybrid model (Gemma 3: sliding-window and full-attention layers) through vLLM with its
hybrid KV cache manager on and kvstore's connector: one process saves every KV group's blocks
to a daemon, a fresh one loads the prefix back, per group, and decodes what vLLM alone decodes.

vLLM's block is 32 tokens here (``block_size``). The tiny Gemma 3 (tiny_gemma3.py) has five
sliding groups (window 48 tokens: a hit needs 2 blocks of each) and one full group, one layer
each; Gemma-3-270M has five sliding groups (window 512: 16 blocks) and one full group of three
layers each. A kvstore block here is one vLLM block of one group's layers.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import run_plan
from tiny_gemma3 import WINDOW

from tests.daemon.daemon_helpers import DaemonProc

BLOCK = 32
P = [(i * 7919) % 997 + 2 for i in range(300)]  # 9 loadable blocks
Q = P[: 6 * BLOCK] + [(i * 104729) % 991 + 3 for i in range(100)]  # P's first 6 blocks, then its own
SLOT_BYTES = 2 * BLOCK * 2 * 32 * 4  # a block (one layer of a group): (K, V) x 32 tokens x 2 heads x 32 dims, fp32
HMA_OFF = "Turning off hybrid kv cache manager"  # vLLM's warning when a connector lacks SupportsHMA


def llm(model: str, extra: dict[str, Any] | None, **options: Any) -> dict[str, Any]:
    # prompts are token ids: no tokenizer (Gemma 3's 262k-token one takes seconds to load)
    return {"llm": {"model": model, "extra": extra,
                    "options": {"block_size": BLOCK, "skip_tokenizer_init": True, **options}}}


def gen(*prompts: list[int], max_tokens: int = 8) -> dict[str, Any]:
    return {"generate": [{"ids": ids} for ids in prompts], "max_tokens": max_tokens, "logprobs": True}


def same_output(run: dict[str, Any], ref: dict[str, Any]) -> bool:
    """Equal greedy tokens, and equal logprobs to float noise (a recompute batches differently,
    ~1e-6; a window block missing or misplaced moves them far more): random models repeat
    tokens, so the tokens alone say little."""
    return run["tokens"] == ref["tokens"] and all(
        abs(a - b) < 1e-3 for a, b in zip(run["logprobs"], ref["logprobs"], strict=True))


def check_hybrid(start: dict[str, Any], num_sliding: int, window: int, layers: int) -> None:
    assert start["hybrid"], "vLLM turned its hybrid KV cache manager off"
    assert start["groups"] == [["SlidingWindowSpec", window, layers]] * num_sliding + [["FullAttentionSpec", None,
                                                                                         layers]]


@pytest.fixture
def daemon(tmp_path: Path):  # type: ignore[no-untyped-def]
    # one namespace slot: all 64 MiB for this model's (Gemma-3-270M's 126 blocks are 24 MiB)
    proc = DaemonProc(tmp_path / "data", "--max-namespaces", "1", host_mem="64MiB", disk="64MiB")
    yield proc
    if proc.proc.poll() is None:
        proc.kill9()


def test_tiny_gemma3_hits_per_group_in_a_fresh_process(gemma3_dir: str, daemon: DaemonProc) -> None:
    store = {"store_url": daemon.unix}
    log: list[str] = []
    ref_start, (ref_p, ref_q), a_start, (a,) = run_plan([
        llm(gemma3_dir, None), gen(P, Q),
        llm(gemma3_dir, store), gen(P),
    ], log=log)
    b_start, (b_p, b_q) = run_plan([llm(gemma3_dir, store), gen(P, Q)], log=log)
    for start in (ref_start, a_start, b_start):
        check_hybrid(start, num_sliding=5, window=WINDOW, layers=1)
    assert HMA_OFF not in "".join(log)
    assert ref_p["logprobs"] != ref_q["logprobs"]  # the prompts' tails differ: so does what they decode

    # The first process: 300 + 8 tokens computed, 9 full blocks of each of the 6 groups saved;
    # each sliding group's blocks 0-6 lie below the window of the last boundary (9): cooled.
    assert same_output(a, ref_p) and a["cached"] == 0
    assert a["counters"]["saved_blocks"] == 6 * 9 and a["counters"]["save_skipped"] == 0
    assert a["counters"]["cooled_blocks"] == 5 * 7

    # A fresh process: the hit is all 9 blocks; the full group loads 9, each sliding group only
    # the 2 of its window (7, 8).
    c = b_p["counters"]
    assert b_p["cached"] == 9 * BLOCK and same_output(b_p, ref_p)
    assert c["loaded_blocks"] == 9 + 5 * 2 and c["loaded_window_blocks"] == 5 * 2 and c["load_errors"] == 0
    assert c["loaded_bytes"] == 19 * SLOT_BYTES
    assert c["async_loads"] == 1  # a hybrid model's loads are asynchronous (see scheduler.py)
    # Q shares P's first 6 blocks: a hit at boundary 6 needs each sliding group's blocks 4 and 5,
    # which P's run stored (cooled: still held, first to go under pressure).
    assert b_q["cached"] == 6 * BLOCK and same_output(b_q, ref_q)
    assert b_q["counters"]["loaded_window_blocks"] == 5 * 2 and b_q["counters"]["load_errors"] == 0


def gemma3_270m_dir() -> str:
    """vLLM's copy of Gemma-3-270M: the Hugging Face directory kvstore converts its GGUF into
    (vLLM 0.32 has no GGUF loader), cached under the model cache."""
    from kvstore.engine.checkpoint import gemma3_gguf
    from kvstore.engine.checkpoint.model_cache import convert_gguf

    path = gemma3_gguf() if importlib.util.find_spec("gguf") is not None else None
    if path is None:
        if os.environ.get("CI", "").lower() == "true":
            raise RuntimeError("Gemma-3-270M is not installed in .venv-vllm (make test-vllm installs it)")
        pytest.skip("Gemma-3-270M or the gguf package is not installed (make test-vllm installs them)")
    return str(convert_gguf(path).path)


def test_gemma3_270m_loads_only_the_windows_of_its_sliding_groups(daemon: DaemonProc) -> None:
    model = gemma3_270m_dir()
    store = {"store_url": daemon.unix}
    prompt = [(i * 7919) % 20000 + 300 for i in range(700)]  # 21 loadable blocks; the window is 16
    options = {"max_model_len": 1024, "kv_cache_memory_bytes": 128 << 20, "max_num_seqs": 2,
               "max_num_batched_tokens": 1024}
    log: list[str] = []
    ref_start, (ref,), a_start, (a,) = run_plan([
        llm(model, None, **options), gen(prompt, max_tokens=4),
        llm(model, store, **options), gen(prompt, max_tokens=4),
    ], log=log, timeout=600)
    b_start, (b,) = run_plan([llm(model, store, **options), gen(prompt, max_tokens=4)], log=log, timeout=600)
    for start in (ref_start, a_start, b_start):
        check_hybrid(start, num_sliding=5, window=512, layers=3)
    assert HMA_OFF not in "".join(log)
    assert same_output(a, ref) and a["counters"]["saved_blocks"] == 6 * 21
    c = b["counters"]
    assert b["cached"] == 21 * BLOCK and same_output(b, ref)
    assert c["loaded_blocks"] == 21 + 5 * 16 and c["loaded_window_blocks"] == 5 * 16 and c["load_errors"] == 0
    # one block: 3 layers x (K, V) x 32 tokens x 1 head x 256 dims, fp32
    assert c["loaded_bytes"] == (21 + 5 * 16) * 3 * 2 * BLOCK * 256 * 4


def test_a_corrupt_group_block_fails_the_load_and_vllm_recomputes(gemma3_dir: str, tmp_path: Path) -> None:
    """vLLM 0.32 takes a failed load of a model of several KV cache groups only as a failed
    asynchronous receive: the load falls short on one group's block, the request is recomputed
    whole and decodes what vLLM alone decodes."""
    disk = tmp_path / "kv"
    store = {"host_bytes": "16MiB", "disk_path": str(disk), "disk_bytes": "32MiB", "write_policy": "write_through"}
    _, (a,), _, (ref,), _, _, (b,) = run_plan([
        llm(gemma3_dir, store), gen(P),
        llm(gemma3_dir, None), gen(P),  # the first store closed: its blocks are on disk only
        # the saver puts group after group, in block order: slot 45 is the full group's block 0
        {"flip": {"path": str(disk / "slab-000.bin"), "offset": 45 * SLOT_BYTES + 1000}},
        llm(gemma3_dir, store), gen(P),
    ])
    assert a["counters"]["saved_blocks"] == 6 * 9 and same_output(a, ref)
    c = b["counters"]
    assert c["async_loads"] == 1 and c["loaded_blocks"] == 0 and c["load_errors"] == 9 + 5 * 2
    assert same_output(b, ref)
