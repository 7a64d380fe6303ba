"""LOADING overlaps other requests' steps; the fetch policy weighs fetch time against recompute."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kvstore import KVLayout, StoreConfig, TieredStore
from kvstore.engine import SamplingParams
from kvstore.engine.fetcher import LATENCY_S, Fetcher
from kvstore.engine.sequence import SeqStatus
from kvstore.results import FetchHandle
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


def test_fetch_lands_straight_in_the_pool_run_by_run() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.float32)
    store = TieredStore(StoreConfig(layout=layout, model_id="fetch", host_bytes=64 * 4096))
    keys = store.block_keys(list(range(2 * 12)))
    blocks = torch.randn((12, *layout.block_shape))
    store.put(keys, blocks)
    pool = torch.full((40, *layout.block_shape), float("nan"))
    fetcher = Fetcher(store, pool, "always", 2)
    for ids in ([5, 6, 7, 8], [9, 10, 2, 3, 30], list(range(0, 24, 2))):  # 1 run, 3 runs, 12 runs (staged)
        n = len(ids)
        loading = fetcher.start(keys[:n], ids, ("host",) * n)
        assert (loading.staging is None) == (len(ids) < 12)
        assert loading.handle.wait(10)
        assert fetcher.finish(loading) == ("host",) * n
        assert torch.equal(pool[torch.tensor(ids)], blocks[:n])
    # a run that misses ends the delivered run there, even if later runs arrived
    store.delete(keys[2:3])
    loading = fetcher.start(keys[:5], [20, 21, 22, 11, 12], ("host",) * 5)
    assert loading.handle.wait(10) and fetcher.finish(loading) == ("host", "host")
    store.close()


def test_stages_of_a_host_hit_add_up_to_its_ttft(llama_dir: Path) -> None:
    with make_engine(llama_dir) as llm:
        prompt = list(range(3, 3 + 41))
        llm.generate([prompt], GREEDY)
        llm.evict_device_cache()
        m = llm.generate([prompt], GREEDY)[0].metrics
        assert m.cached_tokens["host"] == 40
        assert m.ttft_s is not None and abs(sum(m.stages.values()) - m.ttft_s) < 1e-6
        assert all(m.stages[s] > 0 for s in ("hash", "lookup", "fetch", "prefill")), m.stages
        assert m.stages["device_copy"] == 0.0  # fetched straight into the pool
