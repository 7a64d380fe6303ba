"""LLMEngine.abort: a request stops wherever it is (waiting, loading, prefilling, decoding,
forked into n samples) and its blocks return to the pool; the other requests' outputs do not
change."""

from __future__ import annotations

import pytest

from engine import SamplingParams
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
    assert out.metrics.cached_tokens["device"] == (len(prompt) - 1) // 4 * 4
    llm.close()
