"""The same greedy output whether the prefix is computed, shared on device, fetched from host,
or read from disk after a restart; tenants never share; waste stays under one partial block."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.engine import SamplingParams
from tests.engine.conftest import GREEDY, PROMPTS, make_engine

LONG = [list(range(3, 3 + 29)), [*list(range(40, 40 + 22)), 7], [11, 12] * 9]  # 29, 23, 18 tokens


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> list[list[int]]:
    llm = make_engine(llama_dir, enable_prefix_caching=False, host_bytes=0)
    try:
        outs = llm.generate(LONG, GREEDY)
        assert all(sum(o.metrics.cached_tokens.values()) == 0 for o in outs)
        assert [o.metrics.num_computed_tokens for o in outs] == [len(p) for p in LONG]
        return [o.token_ids for o in outs]
    finally:
        llm.close()


def full_blocks(prompt: list[int], block_size: int = 4) -> int:
    # a prompt found whole (a multiple of block_size) runs only its last token again, for its
    # logits: its K/V come from the cache, so all its tokens count as cached
    return len(prompt) // block_size


def test_device_hits(llama_dir: Path, expected: list[list[int]]) -> None:
    llm = make_engine(llama_dir)
    try:
        assert [o.token_ids for o in llm.generate(LONG, GREEDY)] == expected
        again = llm.generate(LONG, GREEDY)
        assert [o.token_ids for o in again] == expected
        for prompt, out in zip(LONG, again, strict=True):
            assert out.metrics.cached_tokens == {"device": 4 * full_blocks(prompt), "host": 0, "disk": 0}
            assert out.metrics.num_computed_tokens == len(prompt) - 4 * full_blocks(prompt)
        llm.check_integrity()
    finally:
        llm.close()


def test_host_hits_after_device_eviction(llama_dir: Path, expected: list[list[int]]) -> None:
    llm = make_engine(llama_dir)
    try:
        llm.generate(LONG, GREEDY)
        assert llm.evict_device_cache() > 0
        assert llm.stats()["device"]["num_cached"] == 0
        again = llm.generate(LONG, GREEDY)
        assert [o.token_ids for o in again] == expected
        for prompt, out in zip(LONG, again, strict=True):
            assert out.metrics.cached_tokens == {"device": 0, "host": 4 * full_blocks(prompt), "disk": 0}
        llm.check_integrity()
        llm.store.check_integrity()
    finally:
        llm.close()


def test_disk_hits_after_restart(llama_dir: Path, tmp_path: Path, expected: list[list[int]]) -> None:
    disk = dict(disk_path=tmp_path / "kv", disk_bytes=256 * 4096)
    llm = make_engine(llama_dir, **disk)
    assert [o.token_ids for o in llm.generate(LONG, GREEDY)] == expected
    llm.close()  # device blocks written back to the store, the store to disk
    llm = make_engine(llama_dir, **disk)
    try:
        again = llm.generate(LONG, GREEDY)
        assert [o.token_ids for o in again] == expected
        for prompt, out in zip(LONG, again, strict=True):
            assert out.metrics.cached_tokens == {"device": 0, "host": 0, "disk": 4 * full_blocks(prompt)}
    finally:
        llm.close()


ALIGNED = [list(range(5, 5 + 24)), [9, 4] * 8]  # 24 and 16 tokens: whole blocks of 4


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_a_prompt_found_whole_runs_only_its_last_token(llama_dir: Path, tmp_path: Path, tier: str) -> None:
    # its last token runs again for its logits; the K/V its cached last block holds are used,
    # not written again (vLLM computes the whole last block again here)
    base = make_engine(llama_dir, enable_prefix_caching=False, host_bytes=0)
    expected = [o.token_ids for o in base.generate(ALIGNED, GREEDY)]
    base.close()
    disk = dict(disk_path=tmp_path / "kv", disk_bytes=256 * 4096)
    llm = make_engine(llama_dir, **disk)
    try:
        assert [o.token_ids for o in llm.generate(ALIGNED, GREEDY)] == expected
        if tier == "host":
            llm.evict_device_cache()
        elif tier == "disk":
            llm.close()
            llm = make_engine(llama_dir, **disk)
        # device hits share blocks cached before the request: their bytes must stay as they were
        cached_ids = sorted(llm.block_manager.cached.values()) if tier == "device" else []
        before = llm.pool.pool[cached_ids].clone()
        again = llm.generate(ALIGNED, GREEDY)
        assert [o.token_ids for o in again] == expected
        for prompt, out in zip(ALIGNED, again, strict=True):
            assert out.metrics.cached_tokens == {"device": 0, "host": 0, "disk": 0, tier: len(prompt)}
            assert out.metrics.num_computed_tokens == out.metrics.num_recomputed_tokens == 0
        if tier == "device":
            assert len(cached_ids) >= sum(len(p) // 4 for p in ALIGNED)  # and blocks of output
            assert torch.equal(llm.pool.pool[cached_ids], before), "a cached block was written"
        llm.check_integrity()
    finally:
        llm.close()


def test_fetch_policy_never_recomputes(llama_dir: Path, expected: list[list[int]]) -> None:
    llm = make_engine(llama_dir, fetch_policy="never")
    try:
        llm.generate(LONG, GREEDY)
        llm.evict_device_cache()
        again = llm.generate(LONG, GREEDY)
        assert [o.token_ids for o in again] == expected
        assert all(o.metrics.cached_tokens["host"] == 0 for o in again)
    finally:
        llm.close()


class FailingStore:
    """A real TieredStore whose fetches deliver only the first ``keep`` blocks (as after an I/O
    error, a checksum mismatch or an eviction in between)."""

    def __init__(self, store: Any, keep: int) -> None:
        self._store, self.keep = store, keep

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def fetch(self, keys: list[bytes], into: Any) -> Any:
        return self._store.fetch(keys[: self.keep] if self.keep else keys[:1], into=into[: max(self.keep, 1)]) \
            if self.keep else _Failed()


class _Failed:
    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        raise OSError("simulated I/O error")

    def add_done_callback(self, fn: Any) -> None:
        fn(self)


@pytest.mark.parametrize("keep", [0, 2])
def test_failed_fetch_falls_back_to_recompute(llama_dir: Path, expected: list[list[int]], keep: int) -> None:
    from kvstore.engine import LLMEngine

    first = make_engine(llama_dir)
    first.generate(LONG, GREEDY)
    first.evict_device_cache()  # the store now holds every full block
    llm = LLMEngine(str(llama_dir), block_size=4, kv_cache_bytes=64 * 2048, fetch_policy="always",
                    store=FailingStore(first.store, keep))
    try:
        again = llm.generate(LONG, GREEDY)
        assert [o.token_ids for o in again] == expected
        for prompt, out in zip(LONG, again, strict=True):
            assert out.metrics.cached_tokens["host"] == 4 * keep
            assert out.metrics.num_computed_tokens == len(prompt) - 4 * keep
        assert llm.stats()["engine"]["failed_fetch_blocks"] > 0
        llm.check_integrity()
    finally:
        llm.close()
        first.close()


def test_tenants_never_share(llama_dir: Path) -> None:
    llm = make_engine(llama_dir)
    try:
        prompt = LONG[0]
        a = llm.generate(prompt, GREEDY, tenant="acme")[0]
        b = llm.generate(prompt, GREEDY, tenant="globex")[0]
        assert a.token_ids == b.token_ids
        assert sum(b.metrics.cached_tokens.values()) == 0
        llm.evict_device_cache()
        c = llm.generate(prompt, GREEDY, tenant="initech")[0]
        assert sum(c.metrics.cached_tokens.values()) == 0
        again = llm.generate(prompt, GREEDY, tenant="acme")[0]
        assert again.metrics.cached_tokens["host"] == 4 * full_blocks(prompt)
    finally:
        llm.close()


def test_fragmentation_under_one_partial_block(llama_dir: Path) -> None:
    llm = make_engine(llama_dir)
    try:
        ids = [llm.add_request(p, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
        steps = 0
        while llm.has_unfinished_requests():
            llm.step()
            steps += 1
            for seq in llm.scheduler.running:
                waste = len(seq.block_table) * 4 - seq.num_cached_tokens
                assert 0 <= waste < 4, f"sequence {seq.seq_id} wastes {waste} slots"
        assert steps >= 9 and len(ids) == len(PROMPTS)
    finally:
        llm.close()


def test_n_samples_share_prompt_blocks_and_copy_on_write(llama_dir: Path) -> None:
    llm = make_engine(llama_dir)
    try:
        prompt = LONG[1]  # 23 tokens: 5 full blocks and a partial one that the samples must copy
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=3, ignore_eos=True)
        rid = llm.add_request(prompt, params)
        llm.step()  # prefill; the samples fork sharing every prompt block
        request = llm._requests[rid]
        tables = [s.block_table for s in request.seqs]
        assert len(tables) == 3 and tables[0] == tables[1] == tables[2]
        assert all(llm.block_manager.blocks[b].ref_count == 3 for b in tables[0])
        llm.step()  # first decode: each sample writes into the partial block -> copies
        tables = [s.block_table for s in request.seqs]
        assert tables[0][:5] == tables[1][:5] == tables[2][:5]
        assert len({t[5] for t in tables}) == 3
        out = None
        while llm.has_unfinished_requests():
            for o in llm.step():
                out = o
        assert out is not None and out.finished and len(out.outputs) == 3
        seeded = make_engine(llama_dir).generate(prompt, params)[0]
        assert [c.token_ids for c in seeded.outputs] == [c.token_ids for c in out.outputs]
        llm.check_integrity()
    finally:
        llm.close()


def test_preemption_keeps_output(llama_dir: Path, expected: list[list[int]]) -> None:
    # 12 blocks of 4 tokens for three prompts needing 8 + 6 + 5 blocks at the end: someone waits
    # or is preempted; its prefix comes back from the device cache or the host tier.
    llm = make_engine(llama_dir, kv_cache_bytes=12 * 2048)
    try:
        outs = llm.generate(LONG, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert [o.token_ids for o in outs] == expected
        assert llm.stats()["engine"]["preemptions"] > 0
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        llm.check_integrity()
    finally:
        llm.close()


SHARED = list(range(100, 124))  # 6 full blocks
TOGETHER = [[*SHARED, 7 + i, 30 + i, 60 + i] for i in range(4)]


@pytest.mark.parametrize("budget", [2048, 30])
def test_prompts_arriving_together_compute_their_shared_prefix_once(llama_dir: Path, budget: int) -> None:
    # Four prompts over one new prefix, queued before the first step. The first's chunk
    # computes the prefix; the others, admitted after it in the same step (budget 2048) or a
    # later one (budget 30: the prefix spans two steps), share its blocks instead of computing
    # them again, reading the rows it writes in the same layer pass. The text is the no-cache text.
    reference = make_engine(llama_dir, enable_prefix_caching=False, host_bytes=0)
    llm = make_engine(llama_dir, max_num_batched_tokens=budget, host_bytes=0)
    try:
        expected = [o.token_ids for o in reference.generate(TOGETHER, GREEDY)]
        outs = llm.generate(TOGETHER, GREEDY)
        assert [o.token_ids for o in outs] == expected
        computed = sum(o.metrics.num_computed_tokens for o in outs)
        hits = [o.metrics.cached_tokens["device"] for o in outs]
        assert hits[0] == 0 and computed + sum(hits) == sum(len(p) for p in TOGETHER)
        if budget == 2048:  # the whole prefix in the first step: computed once
            assert hits[1:] == [len(SHARED)] * 3 and computed == len(SHARED) + 3 * 4
        else:  # the second prompt's first chunk shares what the first's computes, then its own
            assert all(h > 0 for h in hits[1:]) and computed < sum(len(p) for p in TOGETHER) - 3 * 16
        llm.check_integrity()
    finally:
        llm.close()
        reference.close()


def test_a_step_that_fails_leaves_no_block_findable(llama_dir: Path) -> None:
    # While the failed step was built, the first prompt's prefix blocks were findable (the
    # others shared them); they hold no KV, so none may be sealed or stay findable, and the
    # prompt computes its prefix again afterwards.
    llm = make_engine(llama_dir, host_bytes=0)
    try:
        run = llm.runner.run

        def fail(items: Any) -> Any:
            raise RuntimeError("an injected fault in the forward")

        llm.runner.run = fail  # type: ignore[method-assign]
        ids = [llm.add_request(p, GREEDY) for p in TOGETHER]
        with pytest.raises(RuntimeError, match="injected"):
            llm.step()
        llm.runner.run = run  # type: ignore[method-assign]
        keys = llm._requests[ids[0]].seqs[0].block_keys[:6]
        assert len(keys) == 6 and llm.block_manager.cached == {}
        tables = [llm._requests[i].seqs[0].block_table[:6] for i in ids]
        assert tables[1] == tables[0]  # shared while the step was built
        for request_id in ids:
            llm.abort(request_id)
        llm.step()  # nothing to run; the next schedule forgets the failed step's blocks
        assert llm.block_manager.match(keys) == []
        again = llm.generate(TOGETHER[:1], GREEDY)[0]
        assert again.metrics.cached_tokens["device"] == 0
        llm.check_integrity()
    finally:
        llm.close()


def test_preempted_samples_count_each_prompt_token_once(llama_dir: Path) -> None:
    # 8 samples of a 40-token prompt growing by 20 in a 16-block pool (no host tier) preempt
    # each other; a readmission finds the request's own blocks again (no cache hits) or
    # recomputes what was evicted (recomputed, not computed: the prompt was computed once).
    prompt = list(range(3, 43))
    llm = make_engine(llama_dir, kv_cache_bytes=16 * 2048, host_bytes=0)
    try:
        llm.generate([prompt], GREEDY)  # its 9 full blocks are now device hits
        out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, n=8))[0]
        m = out.metrics
        assert m.num_preemptions > 0 and m.num_generated_tokens == 8 * 20
        assert m.cached_tokens == {"device": 4 * full_blocks(prompt), "host": 0, "disk": 0}
        assert m.num_computed_tokens == len(prompt) - 4 * full_blocks(prompt)
        assert m.num_recomputed_tokens > 0
        llm.check_integrity()
    finally:
        llm.close()


@pytest.mark.timeout(180)
def test_prefills_stalled_on_a_full_pool_preempt_instead_of_waiting_forever(llama_dir: Path, tmp_path: Path) -> None:
    # Three conversations growing 10 tokens a turn over a 16-block pool: by the fourth turn
    # the three prefills together need more blocks than the pool has, and every running
    # sequence is mid-prefill (none decoding). The newest must yield its blocks, not wait.
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    convs = [[20 + 10 * c + i for i in range(7)] for c in range(3)]
    reference = make_engine(llama_dir, enable_prefix_caching=False, host_bytes=0, kv_cache_bytes=64 * 2048)
    llm = make_engine(llama_dir, kv_cache_bytes=16 * 2048, host_bytes=10 * 4096, disk_path=tmp_path / "disk",
                      disk_bytes=14 * 4096)
    try:
        for turn in range(4):
            outs = llm.generate(convs, params)
            assert [o.token_ids for o in outs] == [o.token_ids for o in reference.generate(convs, params)]
            convs = [c + o.token_ids + [70 + 7 * turn + i for i in range(7)] for c, o in zip(convs, outs, strict=True)]
        assert llm.stats()["engine"]["preemptions"] > 0
        llm.check_integrity()
    finally:
        llm.close()
        reference.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_second_engine_on_the_same_store_hits_what_the_first_computed(
        llama_dir: Path, expected: list[list[int]], policy: str) -> None:
    """Write-through: a block reaches the store once the step that filled it ends, so another
    engine sharing the store finds it while the first still holds it on its device."""
    first = make_engine(llama_dir, device_write_policy=policy)
    second = make_engine(llama_dir, store=first.store)
    try:
        assert [o.token_ids for o in first.generate(LONG, GREEDY)] == expected
        assert first.block_manager.demoter is not None
        first.block_manager.demoter.drain()  # the writes run on its thread
        assert first.stats()["device"]["num_cached"] > 0  # nothing was evicted
        outs = second.generate(LONG, GREEDY)
        assert [o.token_ids for o in outs] == expected
        for prompt, out in zip(LONG, outs, strict=True):
            shared = 4 * full_blocks(prompt) if policy == "write_through" else 0
            assert out.metrics.cached_tokens == {"device": 0, "host": shared, "disk": 0}
        first.check_integrity()
        second.check_integrity()
    finally:
        second.close()
        first.close()


def test_skip_reading_prefix_cache_computes_the_whole_prompt_and_still_stores_it(
        llama_dir: Path, expected: list[list[int]]) -> None:
    llm = make_engine(llama_dir)
    try:
        skip = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True,
                              skip_reading_prefix_cache=True)
        llm.generate(LONG, GREEDY)  # cached on the device now
        outs = llm.generate(LONG, skip)
        assert [o.token_ids for o in outs] == expected
        assert [sum(o.metrics.cached_tokens.values()) for o in outs] == [0, 0, 0]
        assert [o.metrics.num_computed_tokens for o in outs] == [len(p) for p in LONG]
        llm.evict_device_cache()  # a skipping request still stores what it computed: host hits now
        again = llm.generate(LONG, GREEDY)
        assert [o.metrics.cached_tokens["host"] for o in again] == [4 * full_blocks(p) for p in LONG]
        llm.check_integrity()
    finally:
        llm.close()


def test_prompt_logits_over_a_cached_prefix_are_the_rows_after_it(llama_dir: Path) -> None:
    llm = make_engine(llama_dir)
    try:
        prompt = LONG[0]  # 29 tokens: 7 full blocks of 4
        whole = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logits=True))[0]
        assert whole.prompt_logits_start == 0 and whole.prompt_logits is not None
        assert whole.prompt_logits.shape[0] == len(prompt)  # reads no cache by default: every row
        scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logits=True, skip_reading_prefix_cache=False)
        part = llm.generate([prompt], scored)[0]
        assert part.metrics.cached_tokens["device"] == 28
        assert part.prompt_logits_start == 28 and part.prompt_logits is not None
        torch.testing.assert_close(part.prompt_logits, whole.prompt_logits[28:], atol=1e-4, rtol=1e-4)
        assert part.token_ids == whole.token_ids
    finally:
        llm.close()


@pytest.mark.parametrize("bad", [1, "yes"])
def test_skip_reading_prefix_cache_must_be_a_bool(bad: object) -> None:
    with pytest.raises(ValueError, match="skip_reading_prefix_cache must be a bool or None"):
        SamplingParams(skip_reading_prefix_cache=bad)  # type: ignore[arg-type]
