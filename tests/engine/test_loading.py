"""LOADING overlaps other requests' steps; the fetch policy weighs fetch time against recompute."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from engine import SamplingParams
from engine.fetcher import LATENCY_S, Fetcher
from engine.sequence import SeqStatus
from kvstore import KVLayout, StoreConfig, TieredStore
from kvstore.transfer import FetchHandle
from tests.engine.conftest import GREEDY, make_engine

PROMPT = list(range(20, 20 + 27))


class GatedStore:
    """A real TieredStore whose fetches wait for ``gate`` before they copy (a slow lower tier)."""

    def __init__(self, store: TieredStore) -> None:
        self._store = store
        self.gate = threading.Event()
        self._pool = ThreadPoolExecutor(1)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def fetch(self, keys: list[bytes], into: torch.Tensor) -> FetchHandle:
        def slow() -> Any:
            assert self.gate.wait(60), "the test never opened the gate"
            return self._store.fetch(keys, into=into).result()

        return FetchHandle(self._pool.submit(slow), len(keys))


def test_other_requests_decode_while_one_loads(llama_dir: Path) -> None:
    reference = make_engine(llama_dir, enable_prefix_caching=False, host_bytes=0)
    expected = reference.generate(PROMPT, GREEDY)[0].token_ids
    reference.close()

    layout = KVLayout(2, 2, 16, block_size=4, dtype=torch.float32)
    real = TieredStore(StoreConfig(layout=layout, model_id="gated", host_bytes=64 * 4096))
    store = GatedStore(real)
    llm = make_engine(llama_dir, store=store, model_id="gated")
    try:
        llm.generate(PROMPT, GREEDY)
        llm.evict_device_cache()  # the prompt's blocks now live only in the host tier
        other = llm.add_request([7, 8, 9], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        llm.step()
        loader = llm.add_request(PROMPT, GREEDY)
        progress = 0
        for _ in range(8):
            for out in llm.step():
                if out.request_id == other:
                    progress = len(out.token_ids)
            seq = llm._requests[loader].seqs[0]
            assert seq.status == SeqStatus.LOADING
        assert progress >= 8, "the decoding request stalled while the other one was loading"
        store.gate.set()
        result = None
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.request_id == loader and out.finished:
                    result = out
        assert result is not None and result.token_ids == expected
        assert result.metrics.cached_tokens["host"] == 4 * ((len(PROMPT) - 1) // 4)
        assert result.metrics.loading_s > 0
    finally:
        store.gate.set()
        llm.close()
        real.close()


def make_fetcher(policy: str = "auto", bytes_per_block: int = 1 << 20, block_size: int = 16) -> Fetcher:
    pool = torch.empty((2, bytes_per_block), dtype=torch.uint8)
    return Fetcher(None, pool, policy, block_size)


def test_auto_policy_compares_fetch_and_recompute_time() -> None:
    f = make_fetcher()
    f.bandwidth = {"host": 1e9, "disk": 1e8}  # 1 MiB block: ~1 ms from host, ~10 ms from disk
    f.prefill_rate = 16 / 5e-3  # one 16-token block recomputes in 5 ms
    assert f.plan(("host",) * 4) == 4
    assert f.plan(("disk",) * 4) == 0
    assert f.plan(("host", "host", "disk", "disk")) == 2  # fetch the host run, recompute the rest
    assert abs(f.fetch_time(("host", "disk")) - (LATENCY_S + (1 << 20) / 1e9 + (1 << 20) / 1e8)) < 1e-12
    f.prefill_rate = 16 / 50e-3  # slow model: disk wins too
    assert f.plan(("disk",) * 4) == 4
    assert make_fetcher("always").plan(("disk",) * 3) == 3
    assert make_fetcher("never").plan(("host",) * 3) == 0


def test_estimates_follow_measurements() -> None:
    f = make_fetcher()
    f.record_prefill(1600, 2.0)
    assert f.prefill_rate == 800  # the first measurement replaces the default
    f.record_prefill(1600, 1.0)
    assert 800 < f.prefill_rate < 1600
    f.record_prefill(3, 1.0)  # under a block: ignored
    assert 800 < f.prefill_rate < 1600
    f._measure(("host",) * 4, 4 * (1 << 20) / 2e9 + LATENCY_S)
    assert abs(f.bandwidth["host"] - 2e9) / 2e9 < 1e-6
