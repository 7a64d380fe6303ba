"""The trace simulation through the real Router, and the ``kvstore bench route`` command."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.services.router.policy import RoutingPolicyConfig
from kvstore.tools.replay.route_sim import SimConfig, load_requests, simulate
from kvstore.tools.replay.trace import ReplayError


def write_trace(path: Path, conversations: int = 25, turns: int = 5) -> Path:
    """Multi-turn conversations: each turn's prompt extends the previous turn's blocks.

    25 conversations, so that round robin does not keep each on one of 4 replicas by accident.
    """
    lines, next_id = [], 1
    for turn in range(turns):
        for conv in range(conversations):
            base = 1 + conv * 1000
            ids = [0, *range(base, base + 3 * (turn + 1))]  # block 0: a system prompt all share
            next_id = max(next_id, ids[-1] + 1)
            stamp = turn * 20_000 + conv * 400
            lines.append({"timestamp": stamp, "input_length": len(ids) * 512 - 100, "output_length": 40,
                          "hash_ids": ids})
    lines.sort(key=lambda r: r["timestamp"])
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return path


def test_cache_aware_keeps_conversations_where_their_prefix_is(tmp_path: Path) -> None:
    requests = load_requests(write_trace(tmp_path / "t.jsonl"))
    # 25 conversations x 16 blocks at the end: a quarter of them fits one replica, all do not.
    sim = SimConfig(num_replicas=4, capacity_blocks=100, prefill_tokens_per_s=50_000.0, decode_s_per_token=0.01)
    results = {p: simulate(requests, sim, RoutingPolicyConfig(policy=p))  # each checks index == caches
               for p in ("cache_aware", "round_robin", "least_loaded")}
    ceiling = simulate(requests, replace(sim, num_replicas=1, capacity_blocks=400, prefill_tokens_per_s=200_000.0),
                       RoutingPolicyConfig(policy="round_robin"))
    aware, rr = results["cache_aware"], results["round_robin"]
    assert aware.cached_fraction >= 0.95 * ceiling.cached_fraction
    assert aware.cached_fraction >= 3 * rr.cached_fraction
    # too few requests for the per-second load samples: the prefill work computed per replica
    assert max(aware.computed_tokens) <= 1.5 * min(aware.computed_tokens), aware.computed_tokens
    assert aware.reasons.get("cache_hit", 0) > 0 and rr.reasons == {"round_robin": len(requests)}
    assert len(aware.ttft_s) == len(requests) and min(aware.ttft_s) >= 0


def test_bad_traces_are_refused_with_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": -1, "hash_ids": [1]}\n')
    with pytest.raises(ReplayError, match="line 1: 'timestamp'"):
        load_requests(bad)
    with pytest.raises(ReplayError, match="cannot read"):
        load_requests(tmp_path / "missing.jsonl")


def test_bench_route_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", conversations=8, turns=3)
    assert main(["bench", "route", "--trace", str(trace), "--capacity", "20,40", "--index-blocks", "3000",
                 "--rounds", "20", "--repeat", "1", "--no-write"]) == 0
    out = capsys.readouterr().out
    assert "| 40 | cache_aware |" in out and "Decision time" in out and "| 1 |" in out
    assert main(["bench", "route", "--trace", str(tmp_path / "nope.jsonl"), "--no-write"]) == 2
