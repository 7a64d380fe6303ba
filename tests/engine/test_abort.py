"""LLMEngine.abort: a request stops wherever it is (waiting, loading, prefilling, decoding,
forked into n samples) and its blocks return to the pool; the other requests' outputs do not
change."""

from __future__ import annotations

import pytest

from kvstore.engine import SamplingParams
from tests.engine.conftest import make_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TINY = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
            vocab_size=128)


def engine(**kw: object):  # type: ignore[no-untyped-def]
    return make_engine(None, random_model=TINY, **kw)


def run(llm, steps: int = 1000) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    done = {}
    for _ in range(steps):
        if not llm.has_unfinished_requests():
            break
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        llm.check_integrity()
    return done


def free_blocks(llm) -> int:  # type: ignore[no-untyped-def]
    return llm.block_manager.num_available


@pytest.mark.parametrize("steps_before", [0, 1, 3, 6])
def test_abort_at_any_point_frees_blocks_and_leaves_others_alone(steps_before: int) -> None:
    prompts = [list(range(10, 40)), list(range(50, 63)), [7, 8, 9]]
    alone = engine()
    expect = [alone.generate([p], GREEDY)[0].token_ids for p in prompts]
    alone.close()
    llm = engine(max_num_batched_tokens=16)  # chunked prefill: the first prompt takes two steps
    total = free_blocks(llm)
    ids = [llm.add_request(p, GREEDY) for p in prompts]
    victim = llm.add_request(list(range(70, 95)), SamplingParams(max_tokens=50, n=3, temperature=0.0))
    for _ in range(steps_before):
        llm.step()
    assert llm.abort(victim)
    assert not llm.abort(victim) and not llm.abort("no-such-request")
    llm.check_integrity()
    done = run(llm)
    assert [done[i] for i in ids] == expect
    assert victim not in done
    assert free_blocks(llm) == total and llm.block_manager.stats()["num_in_use"] == 0


def test_abort_while_loading_waits_for_the_fetch() -> None:
    llm = engine()
    prompt = list(range(3, 40))
    first = llm.generate([prompt], GREEDY)[0].token_ids
    llm.evict_device_cache()  # the prefix now lives in the host tier only
    rid = llm.add_request(prompt, GREEDY)
    llm.step()
    assert llm.scheduler.loading, "the prompt's prefix should be fetched from the host tier"
    assert llm.abort(rid)
    llm.check_integrity()
    assert not llm.scheduler.loading and not llm.has_unfinished_requests()
    assert llm.block_manager.stats()["num_in_use"] == 0
    # the fetched blocks were published: the next request finds them on the device
    out = llm.generate([prompt], GREEDY)[0]
    assert out.token_ids == first and out.metrics.cached_tokens["device"] > 0
    llm.close()


def test_aborted_prefix_stays_cached() -> None:
    llm = engine()
    prompt = list(range(20, 60))
    rid = llm.add_request(prompt, SamplingParams(max_tokens=30, temperature=0.0))
    for _ in range(3):
        llm.step()
    llm.abort(rid)
    out = llm.generate([prompt], GREEDY)[0]
    assert out.metrics.cached_tokens["device"] == len(prompt)  # 10 full blocks: found whole
    llm.close()


def test_abort_sample_frees_one_sample_and_leaves_its_siblings_alone() -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=3, ignore_eos=True)
    prompt = list(range(10, 30))
    alone = engine()
    expect = alone.generate([prompt], params)[0].outputs
    alone.close()
    assert len({tuple(c.token_ids) for c in expect}) == 3  # seeded samples that differ
    llm = engine()
    total = free_blocks(llm)
    rid = llm.add_request(prompt, params)
    assert not llm.abort_sample(rid, 0) and not llm.abort_sample(rid, 1)  # not forked yet: abort() it
    for _ in range(4):  # the prefill (and every sample's first token), then 3 decode steps
        llm.step()
    held = free_blocks(llm)
    assert llm.abort_sample(rid, 1)
    assert not llm.abort_sample(rid, 1) and not llm.abort_sample(rid, 7) and not llm.abort_sample("nope", 0)
    assert free_blocks(llm) > held  # its own decode block went back
    llm.check_integrity()
    final = None
    while llm.has_unfinished_requests():
        for out in llm.step():
            final = out
        llm.check_integrity()
    assert final is not None and final.finished
    got = final.outputs
    assert [got[i].token_ids for i in (0, 2)] == [expect[i].token_ids for i in (0, 2)]
    assert got[1].token_ids == expect[1].token_ids[:4] and got[1].finish_reason == "abort"
    # aborting every sample ends the request
    rid = llm.add_request(prompt, params)
    llm.step()
    assert all(llm.abort_sample(rid, i) for i in range(3))
    assert not llm.has_unfinished_requests() and not llm.abort(rid)
    assert free_blocks(llm) == total and llm.block_manager.stats()["num_in_use"] == 0
    llm.close()
