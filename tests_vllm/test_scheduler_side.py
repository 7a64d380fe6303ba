"""The scheduler half on its own: lookups, load plans and save plans for vLLM-shaped requests
(plain objects with the fields vLLM's Request and SchedulerOutput carry), against a real
embedded TieredStore. The whole connector runs against real vLLM in test_vllm_connector.py."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvstore import KVLayout
from kvstore.integrations.vllm.backend import GuardedStore
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.settings import ConnectorSettings

B = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=B, dtype=torch.float32)


def request(req_id: str, tokens: list[int], salt: str | None = None, lora: str | None = None,
            mm: Sequence[tuple[str, int, int]] = ()) -> Any:
    features = [SimpleNamespace(identifier=i, mm_position=SimpleNamespace(offset=o, length=n)) for i, o, n in mm]
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(tokens), all_token_ids=list(tokens),
                           cache_salt=salt, lora_request=SimpleNamespace(lora_name=lora) if lora else None,
                           mm_features=features, num_computed_tokens=0)


def step(new: Sequence[tuple[str, list[int], int, int]] = (),
         cached: Sequence[tuple[str, list[int] | None, int, int]] = ()) -> Any:
    """new: (req_id, block_ids, num_computed, num_scheduled); cached: (req_id, new block ids, computed, scheduled)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=c) for r, ids, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, *_ in cached], resumed_req_ids=set(),
                                              new_block_ids=[(ids,) if ids else None for _, ids, _, _ in cached],
                                              num_computed_tokens=[c for _, _, c, _ in cached]),
        num_scheduled_tokens={r: n for r, *_, n in [*new, *cached]})


def make(tmp_path: Path, async_when_idle: bool = False) -> tuple[SchedulerSide, GuardedStore]:
    store = GuardedStore(ConnectorSettings(host_bytes="1MiB", disk_path=str(tmp_path / "kv"), disk_bytes="1MiB"),
                         LAYOUT, "sched-test")
    return SchedulerSide(store, B, ("disk",), async_when_idle=async_when_idle), store


def test_saves_follow_the_blocks_each_step_completes(tmp_path: Path) -> None:
    side, store = make(tmp_path)
    r = request("a", list(range(10, 20)))  # 10 tokens: 2 full blocks, last token in the third
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)
    meta = side.build_connector_meta(step(new=[("a", [7, 8, 9], 0, 10)]))
    assert [(s.block_ids, len(s.keys)) for s in meta.saves] == [([7, 8], 2)] and not meta.loads
    r.all_token_ids += [21, 22]  # two decode steps fill block 3
    assert not side.build_connector_meta(step(cached=[("a", None, 10, 1)])).saves  # 11 tokens: still 2 blocks
    meta = side.build_connector_meta(step(cached=[("a", None, 11, 1)]))
    assert [(s.block_ids, len(s.keys)) for s in meta.saves] == [([9], 1)]
    keys = store.block_keys(r.all_token_ids, "")
    assert meta.saves[0].keys == keys[2:3]  # chained after the prompt's blocks
    side.request_finished(r)
    store.close()


def test_lookups_count_whole_blocks_beyond_vllms_hit_and_never_the_last_token(tmp_path: Path) -> None:
    side, store = make(tmp_path)
    tokens = list(range(100, 112))  # 3 full blocks; the last token's block is never loaded
    keys = store.block_keys(tokens, "")
    assert keys is not None and store.put(keys, torch.randn(3, *LAYOUT.block_shape))
    r = request("b", tokens)
    assert side.get_num_new_matched_tokens(r, 0) == (2 * B, False)  # host hits: loaded inside the step
    assert side.get_num_new_matched_tokens(r, B) == (B, False)  # vLLM had the first block itself
    side.update_state_after_alloc(r, [4, 5, 6], B)
    meta = side.build_connector_meta(step(new=[("b", [4, 5, 6], 2 * B, 4)]))
    (load,) = meta.loads
    assert load.block_ids == [5] and load.keys == keys[1:2] and not load.is_async
    assert [s.block_ids for s in meta.saves] == [[6]]  # the block the step computes
    assert side.get_num_new_matched_tokens(request("c", tokens, salt="other-tenant"), 0) == (0, False)
    store.close()
    side, store = make(tmp_path)  # reopened: the blocks are on disk only
    # no other request in flight: the load runs inside the step, nobody else waits for it
    d = request("d", tokens)
    assert side.get_num_new_matched_tokens(d, 0) == (2 * B, False)
    # while "d" is in flight, another request's disk hit is parked instead
    assert side.get_num_new_matched_tokens(request("e", tokens), 0) == (2 * B, True)
    side.request_finished(d)
    side.request_finished(request("e", tokens))
    assert side.get_num_new_matched_tokens(request("f", tokens), 0) == (2 * B, False)  # alone again
    store.close()
    side, store = make(tmp_path, async_when_idle=True)
    assert side.get_num_new_matched_tokens(request("g", tokens), 0) == (2 * B, True)
    store.close()


def test_load_errors_stop_further_loads_for_that_request(tmp_path: Path) -> None:
    side, store = make(tmp_path)
    tokens = list(range(200, 209))
    keys = store.block_keys(tokens, "")
    assert keys is not None and store.put(keys, torch.randn(2, *LAYOUT.block_shape))
    r = request("e", tokens)
    assert side.get_num_new_matched_tokens(r, 0) == (2 * B, False)
    side.update_state_after_alloc(r, [1, 2, 3], 2 * B)
    side.note_load_errors({2})
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)  # vLLM recomputes; no retry loop
    store.close()


def test_lora_and_multimodal_items_key_only_the_blocks_they_touch(tmp_path: Path) -> None:
    side, store = make(tmp_path)
    tokens = list(range(300, 313))
    plain = request("f", tokens)
    image = request("g", tokens, mm=[("img-1", 5, 2)])  # tokens 5-6: block 1 only
    lora = request("h", tokens, lora="adapter-x")
    side.get_num_new_matched_tokens(plain, 0)
    side.get_num_new_matched_tokens(image, 0)
    side.get_num_new_matched_tokens(lora, 0)
    k_plain, k_image, k_lora = (side._tracked[i].keys for i in "fgh")
    assert k_plain is not None and k_image is not None and k_lora is not None
    assert k_image[0] == k_plain[0] and k_image[1] != k_plain[1] and k_image[2] != k_plain[2]  # chained
    assert all(a != b for a, b in zip(k_lora, k_plain, strict=True))
    store.close()
