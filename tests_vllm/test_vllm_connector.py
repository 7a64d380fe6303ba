"""kvstore as vLLM's KV cache backend, end to end: real vLLM processes, real daemons.

Every output is compared with the same prompt through vLLM without any connector (greedy,
so equal KV means equal tokens). vLLM's CPU block is 128 tokens and the last prompt token is
always computed, so a 600-token prompt has 4 loadable blocks (512 tokens).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, run_plan

from kvstore.tools.bench.redis_local import RedisServer
from tests.daemon.daemon_helpers import DaemonProc
from tests.remote.conftest import require_redis

BLOCK = 128
P = [(i * 7919) % 997 + 2 for i in range(600)]  # 4 loadable blocks
Q = [(i * 104729) % 991 + 3 for i in range(400)]  # 3 loadable blocks
P2 = P + Q[:256]  # 6 loadable blocks, P's 4 first
SLOT_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4  # a disk slot: 2 layers x (K, V) x 128 tokens x 2 heads x 32 dims, fp32


def llm(model: str, extra: dict[str, Any] | None) -> dict[str, Any]:
    return {"llm": {"model": model, "extra": extra}}


def gen(*prompts: tuple[list[int], str | None]) -> dict[str, Any]:
    return {"generate": [{"ids": ids, "salt": salt} for ids, salt in prompts]}


@pytest.fixture(scope="module")
def reference(model_dir: str) -> dict[str, list[int]]:
    """P's and Q's greedy tokens from vLLM with no connector (kvstore never imported)."""
    _, (p, q) = run_plan([llm(model_dir, None), gen((P, None), (Q, None))])
    assert p["cached"] == 0 and q["cached"] == 0 and p["counters"] == {}
    return {"P": p["tokens"], "Q": q["tokens"]}


@pytest.fixture
def daemon(tmp_path: Path):  # type: ignore[no-untyped-def]
    proc = DaemonProc(tmp_path / "data", host_mem="64MiB", disk="64MiB")
    yield proc
    if proc.proc.poll() is None:
        proc.kill9()


def run_docs_block(model_dir: str, socket_url: str) -> dict[str, Any]:
    """docs/vllm.md's ``LLM(...)`` block as written, with its MODEL_DIR, PROMPT and socket filled in."""
    text = (ROOT / "docs" / "vllm.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    llm_blocks = [block for block in blocks if "LLM(" in block]
    assert len(llm_blocks) == 1, f"{len(llm_blocks)} of the {len(blocks)} python blocks build an LLM(...)"
    (code,) = llm_blocks
    assert code.count("unix:///run/kvstore/kvstore.sock") == 1
    code = code.replace("unix:///run/kvstore/kvstore.sock", socket_url)
    script = (f"MODEL_DIR, PROMPT = {model_dir!r}, {P!r}\n{code}\nimport json, kvstore.integrations.vllm as kv\n"
              "print('RESULT ' + json.dumps({'tokens': list(out.outputs[0].token_ids), "
              "'cached': out.num_cached_tokens, 'counters': (kv.flush(60), kv.counters())[1]}))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the block sets it itself
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])  # type: ignore[no-any-return]


def test_a_fresh_process_loads_what_another_saved_and_salts_never_share(
        model_dir: str, reference: dict[str, list[int]], daemon: DaemonProc) -> None:
    # The first process is docs/vllm.md's example: it saves the prompt's blocks to the daemon.
    a = run_docs_block(model_dir, daemon.unix)
    assert a["tokens"][:8] == reference["P"]  # the example decodes 16 tokens, greedily
    assert a["cached"] == 0 and a["counters"]["hit_blocks"] == 0
    assert a["counters"]["saved_blocks"] == 4  # 615 computed tokens: 4 full blocks
    store = {"store_url": daemon.unix}

    # A second process, a new vLLM with an empty device cache, same daemon.
    _, (b, b_salted), _, (c_salted, c_other) = run_plan([
        llm(model_dir, store), gen((P, None), (P, "tenant-1")),
        llm(model_dir, store), gen((P, "tenant-1"), (P, "tenant-2")),
    ])
    assert b["cached"] == 4 * BLOCK and b["counters"]["loaded_blocks"] == 4 and b["counters"]["load_errors"] == 0
    assert b["tokens"] == reference["P"]
    # A salt is a tenant: the unsalted blocks are not its, vLLM's own cache is salted too.
    assert b_salted["counters"]["hit_blocks"] == 0 and b_salted["cached"] == 0
    assert b_salted["tokens"] == reference["P"] and b_salted["counters"]["saved_blocks"] == 4
    # The same salt, in a fresh vLLM instance: the blocks come from kvstore.
    assert c_salted["cached"] == 4 * BLOCK and c_salted["counters"]["loaded_blocks"] == 4
    assert c_salted["tokens"] == reference["P"]
    assert c_other["counters"]["hit_blocks"] == 0 and c_other["cached"] == 0
    assert c_other["tokens"] == reference["P"]


def test_a_killed_daemon_costs_hits_never_requests(model_dir: str, reference: dict[str, list[int]],
                                                   daemon: DaemonProc) -> None:
    store = {"store_url": daemon.unix, "retry_s": 0.5}
    _, (a,), _, (q, p_salted), _, (p_after,) = run_plan([
        llm(model_dir, store), gen((P, None)),
        {"kill": daemon.proc.pid},  # mid-life: the connection breaks under the connector
        gen((Q, None), (P, "tenant-1")),
        llm(model_dir, store), gen((P, None)),  # a new vLLM while nothing listens
    ])
    daemon.proc.wait(10)
    assert a["tokens"] == reference["P"] and a["counters"]["saved_blocks"] == 4
    for r, ref in ((q, reference["Q"]), (p_salted, reference["P"]), (p_after, reference["P"])):
        assert r["tokens"] == ref
        assert r["cached"] == 0 and r["counters"]["hit_blocks"] == 0 and r["counters"]["loaded_blocks"] == 0
    assert q["counters"]["save_skipped"] + p_salted["counters"]["save_skipped"] > 0


@pytest.mark.parametrize("async_when_idle", [True, False], ids=["async-load", "load-in-the-step"])
def test_a_corrupt_block_is_recomputed(model_dir: str, reference: dict[str, list[int]], tmp_path: Path,
                                       async_when_idle: bool) -> None:
    disk = tmp_path / "kv"
    store = {"host_bytes": "16MiB", "disk_path": str(disk), "disk_bytes": "32MiB", "write_policy": "write_through",
             "async_when_idle": async_when_idle}
    _, (a,), _, _, _, (b,) = run_plan([
        llm(model_dir, store), gen((P, None)),
        llm(model_dir, None),  # the first instance is gone: its store closed, the blocks are on disk only
        {"flip": {"path": str(disk / "slab-000.bin"), "offset": 2 * SLOT_BYTES + 1000}},
        llm(model_dir, store), gen((P, None)),
    ])
    assert a["counters"]["saved_blocks"] == 4
    assert b["tokens"] == reference["P"]
    # Slots are taken in order, so the third block is the corrupt one: two load, the rest recompute.
    # disk-tier hits load outside the step while others run; this request runs alone, so only
    # async_when_idle parks it
    assert b["counters"]["async_loads"] == (1 if async_when_idle else 0)
    assert b["counters"]["loaded_blocks"] == 2 and b["counters"]["load_errors"] >= 1
    # (vLLM's num_cached_tokens still counts the 4 blocks: it is recorded when the load is planned.)


def test_kv_computed_over_a_block_that_failed_to_load_is_never_stored(model_dir: str, tmp_path: Path) -> None:
    """P is stored, its third block corrupt; P2 extends P by two blocks. The step that loads P's
    first blocks into vLLM also computes blocks 4 and 5, attending to the two it could not load:
    that KV is wrong under the right keys, and the store keeps the first copy of a key. Every
    block the store holds in the end must be a clean run's (to float noise: a recompute batches
    differently, ~1e-6; the wrong KV was off by ~0.2)."""
    def store(path: Path) -> dict[str, Any]:
        return {"host_bytes": "16MiB", "disk_path": str(path), "disk_bytes": "32MiB", "write_policy": "write_through"}

    disk = tmp_path / "kv"
    results = run_plan([
        llm(model_dir, store(tmp_path / "clean")), gen((P2, None)),
        {"stored": {"ids": P2, "path": str(tmp_path / "clean.pt")}},
        llm(model_dir, store(disk)), gen((P, None)),
        llm(model_dir, None),
        {"flip": {"path": str(disk / "slab-000.bin"), "offset": 2 * SLOT_BYTES + 1000}},
        llm(model_dir, store(disk)), gen((P2, None)),  # loads in the step (alone): 2 of 4 blocks arrive
        {"stored": {"ids": P2, "path": str(tmp_path / "after.pt")}},
    ])
    (clean_run,), held_clean, (run,), held = results[1], results[2], results[8], results[9]
    assert held_clean == list(range(6))
    assert run["tokens"] == clean_run["tokens"]
    assert run["counters"]["loaded_blocks"] == 2 and run["counters"]["load_errors"] >= 1
    assert run["counters"]["async_loads"] == 0  # the case at hand: a load inside the step
    assert held == list(range(6))  # the blocks computed after the load are saved once it is settled
    clean, after = torch.load(tmp_path / "clean.pt"), torch.load(tmp_path / "after.pt")
    diffs = {i: float((after[i] - clean[i]).abs().max()) for i in held}
    assert all(d < 1e-3 for d in diffs.values()), f"wrong KV stored, max abs difference per block: {diffs}"


def test_a_remote_tier_hit_is_counted_and_loaded(model_dir: str, reference: dict[str, list[int]],
                                                 tmp_path: Path) -> None:
    """An embedded store's remote tier (a real redis-server) shared by two instances in turn; vLLM's
    stats on (as in vllm serve), so it asks get_external_cache_hit_sources about a remote hit."""
    require_redis()
    redis = RedisServer.start(tmp_path / "redis")
    try:
        store = {"host_bytes": "16MiB", "remote_url": redis.url}
        _, _, _, _, (b,) = run_plan([
            llm(model_dir, store), gen((P, None)),
            llm(model_dir, None),  # the first store closed: its blocks flushed to the remote tier
            {"llm": {"model": model_dir, "extra": store, "options": {"disable_log_stats": False}}}, gen((P, None)),
        ])
    finally:
        redis.close()
    assert b["tokens"] == reference["P"]
    assert b["cached"] == 4 * BLOCK and b["counters"]["loaded_blocks"] == 4 and b["counters"]["load_errors"] == 0


def test_prompt_embeddings_pass_through_uncached(model_dir: str, tmp_path: Path) -> None:
    """vLLM allows prompt embeddings with a connector; their token ids are placeholders (0), and
    keys of them would name every embeddings prompt of a length alike: kvstore neither looks them
    up nor saves them (before, the lookup's len(prompt_token_ids) killed the engine core)."""
    store = {"host_bytes": "16MiB"}
    _, out = run_plan([
        {"llm": {"model": model_dir, "extra": store, "options": {"enable_prompt_embeds": True}}},
        {"generate": [{"embeds": {"n": 300, "seed": 1}}, {"embeds": {"n": 300, "seed": 2}}, {"ids": P}]},
    ])
    first, second, tokens = out
    assert first["tokens"] and second["tokens"]
    for r in (first, second):
        assert r["counters"]["lookups"] == 0 and r["counters"]["saved_blocks"] == 0
    assert tokens["counters"]["saved_blocks"] == 4  # requests of token ids are saved as ever


def test_vllms_per_request_settings_are_honoured(model_dir: str, reference: dict[str, list[int]],
                                                 tmp_path: Path) -> None:
    """``kv_transfer_params={"kvstore": {"store": False}}`` (vLLM's per-request dict for the
    connector) stores none of the request's blocks; vLLM's ``skip_reading_prefix_cache`` asks
    the store nothing and loads nothing. Other requests are served as ever."""
    store = {"host_bytes": "16MiB", "disk_path": str(tmp_path / "kv"), "disk_bytes": "16MiB"}
    no_store = {"extra_args": {"kv_transfer_params": {"kvstore": {"store": False}}}}
    _, (kept_out,), held, (stored,), held_after, _, (read, skipped) = run_plan([
        llm(model_dir, store), {"generate": [{"ids": P, "params": no_store}]},
        {"stored": {"ids": P, "path": str(tmp_path / "none.pt")}},
        {"generate": [{"ids": P}]},
        {"stored": {"ids": P, "path": str(tmp_path / "all.pt")}},
        llm(model_dir, store),  # a fresh vLLM: an empty device cache, the store from disk
        {"generate": [{"ids": P}, {"ids": P, "params": {"skip_reading_prefix_cache": True}}]},
    ])
    assert kept_out["tokens"] == reference["P"] and kept_out["counters"]["saved_blocks"] == 0
    assert held == []  # nothing of the "do not store" request reached the store
    assert stored["counters"]["saved_blocks"] == 4 and held_after == [0, 1, 2, 3]
    assert skipped["cached"] == 0 and skipped["counters"]["lookups"] == 0
    assert skipped["counters"]["loaded_blocks"] == 0 and skipped["tokens"] == reference["P"]
    assert read["cached"] == 4 * BLOCK and read["counters"]["loaded_blocks"] == 4
    assert read["tokens"] == reference["P"]
