"""Two engine processes share one `kvstore serve` daemon as their host and disk tiers.

Process A generates and closes: its device blocks are written back to the daemon's host tier.
Process B, with the same model, token and prompt, fetches the prefix from the daemon and
produces A's greedy output; an engine with another tenant's token finds nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout
from kvstore.engine import LLMEngine, SamplingParams
from kvstore.engine.checkpoint import random_checkpoint
from tests.daemon.daemon_helpers import ROOT, DaemonProc

BLOCK = 4
PROMPT = list(range(7, 7 + 27))  # 6 full blocks are cacheable; the 7th holds the last token
TINY = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=100,
            intermediate_size=96)
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=BLOCK, dtype=torch.float32)
RUN = r"""
import json, sys
import torch
from kvstore.engine import LLMEngine, SamplingParams

url, runs, tiny = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
results = []
for token, prompt in runs:
    llm = LLMEngine(None, store_url=url, store_token=token, block_size=4, kv_cache_bytes=64 * 2048,
                    dtype=torch.float32, fetch_policy="always",
                    random_model=tiny)
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    llm.check_integrity()
    results.append({"tokens": out.token_ids, "cached": out.metrics.cached_tokens,
                    "demoted": llm.stats()["device"]["demoted"], "tenant": llm.store.tenant})
    llm.close()
print(json.dumps(results))
"""


def engine_process(url: str, *runs: tuple[str, list[int]]) -> list[dict]:
    """Run engines one after another in a fresh Python process; their results, in order."""
    proc = subprocess.run([sys.executable, "-c", RUN, url, json.dumps(runs), json.dumps(TINY)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_engine_processes_share_the_daemon(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[[tenant]]\nname = "acme"\ntokens = ["tok-acme"]\n\n'
                      '[[tenant]]\nname = "globex"\ntokens = ["tok-globex"]\n')
    daemon = DaemonProc(tmp_path / "data", "--tokens", str(tokens), host_mem="4MiB", disk="8MiB")
    try:
        (a,) = engine_process(daemon.unix, ("tok-acme", PROMPT))
        assert a["tenant"] == "acme"
        assert a["cached"] == {"device": 0, "host": 0, "disk": 0}
        assert len(a["tokens"]) == 8

        b, other = engine_process(daemon.unix, ("tok-acme", PROMPT), ("tok-globex", PROMPT))
        assert b["cached"] == {"device": 0, "host": 6 * BLOCK, "disk": 0}
        assert b["tokens"] == a["tokens"]
        assert other["tenant"] == "globex"
        assert other["cached"] == {"device": 0, "host": 0, "disk": 0}
        assert other["tokens"] == a["tokens"]  # same model, computed from scratch

        # A's close demoted every full block it computed (prompt and output) to the host tier;
        # a plain client of the same token finds them under the keys it computes itself.
        client = daemon.connect("tok-acme", model_id=random_checkpoint(TINY).model_id, layout=LAYOUT)
        try:
            computed = PROMPT + a["tokens"][:-1]  # the last sampled token is never fed back
            match = client.lookup(client.block_keys(computed))
            assert match.tiers == ("host",) * (len(computed) // BLOCK)
        finally:
            client.close()
    finally:
        assert daemon.stop() == 0


def test_closing_an_engine_whose_daemon_was_killed_still_frees_its_thread_and_connection(tmp_path: Path) -> None:
    # Found by scripts/daemon_kill_loop.py: close() raised from its write-back (the daemon
    # gone) before it stopped the demoter thread and closed the connection, leaking both.
    def demoters() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "engine-demoter"}

    daemon = DaemonProc(tmp_path / "data", host_mem="4MiB", disk="8MiB")
    before = (demoters(), len(os.listdir("/proc/self/fd")))
    llm = LLMEngine(None, store_url=daemon.unix, block_size=BLOCK, kv_cache_bytes=64 * 2048, dtype=torch.float32,
                    random_model=TINY, cpu_decode_kernel=False)
    llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    daemon.kill9()
    with pytest.raises(OSError):  # the device blocks' write-back cannot reach the daemon
        llm.close()
    assert (demoters(), len(os.listdir("/proc/self/fd"))) == before
