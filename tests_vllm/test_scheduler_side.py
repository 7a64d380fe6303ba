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
from tests.daemon.daemon_helpers import DaemonProc

B = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=B, dtype=torch.float32)


def request(req_id: str, tokens: list[int], salt: str | None = None, lora: str | None = None,
            mm: Sequence[tuple[str, int, int]] = (), lora_path: str = "/adapters/a", embeds: bool = False,
            token_ids: bool = True) -> Any:
    """Like vLLM's Request; ``embeds``: it has prompt embeddings (``token_ids``: mixed with ids, else
    embeddings only: vLLM's prompt_token_ids is then None, all_token_ids placeholder zeros)."""
    features = [SimpleNamespace(identifier=i, mm_position=SimpleNamespace(offset=o, length=n)) for i, o, n in mm]
    adapter = SimpleNamespace(lora_name=lora, lora_path=lora_path) if lora else None
    prompt_ids = list(tokens) if token_ids else None
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt_ids, all_token_ids=list(tokens),
                           prompt_embeds=torch.zeros(len(tokens), 8) if embeds else None, cache_salt=salt,
                           lora_request=adapter, mm_features=features, num_computed_tokens=0)


def step(new: Sequence[tuple[str, list[int], int, int]] = (),
         cached: Sequence[tuple[str, list[int] | None, int, int]] = ()) -> Any:
    """new: (req_id, block_ids, num_computed, num_scheduled); cached: (req_id, new block ids, computed, scheduled)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=c) for r, ids, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, *_ in cached], resumed_req_ids=set(),
                                              new_block_ids=[(ids,) if ids else None for _, ids, _, _ in cached],
                                              num_computed_tokens=[c for _, _, c, _ in cached]),
        num_scheduled_tokens={r: n for r, *_, n in [*new, *cached]})


def make(tmp_path: Path, async_when_idle: bool = False, **settings: Any) -> tuple[SchedulerSide, GuardedStore]:
    settings = settings or {"host_bytes": "1MiB", "disk_path": str(tmp_path / "kv"), "disk_bytes": "1MiB"}
    store = GuardedStore(ConnectorSettings.from_extra_config(settings), LAYOUT, "sched-test")
    return SchedulerSide(store, B, ("disk",), async_when_idle=async_when_idle), store


def worker_output(side: SchedulerSide, step: int, invalid: Sequence[int] = ()) -> None:
    """What vLLM hands the scheduler side for a step whose sync loads the workers settled."""
    side.note_worker_output(set(invalid), frozenset({step}))


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
    assert store.try_put(keys, torch.randn(3, *LAYOUT.block_shape))
    r = request("b", tokens)
    assert side.get_num_new_matched_tokens(r, 0) == (2 * B, False)  # host hits: loaded inside the step
    assert side.get_num_new_matched_tokens(r, B) == (B, False)  # vLLM had the first block itself
    side.update_state_after_alloc(r, ([4, 5, 6],), B)
    meta = side.build_connector_meta(step(new=[("b", [4, 5, 6], 2 * B, 4)]))
    (load,) = meta.loads
    assert load.block_ids == [5] and load.keys == keys[1:2] and not load.is_async
    assert not meta.saves  # the block the step computes waits for the load's confirmation
    worker_output(side, meta.step)
    assert [s.block_ids for s in side.build_connector_meta(step(cached=[("b", None, 12, 1)])).saves] == [[6]]
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
    assert store.try_put(keys, torch.randn(2, *LAYOUT.block_shape))
    r = request("e", tokens)
    assert side.get_num_new_matched_tokens(r, 0) == (2 * B, False)
    side.update_state_after_alloc(r, ([1, 2, 3],), 2 * B)
    worker_output(side, side.build_connector_meta(step(new=[("e", [1, 2, 3], 2 * B, 1)])).step, {2})
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)  # vLLM recomputes; no retry loop
    store.close()


def test_no_save_reads_a_block_whose_sync_load_is_unconfirmed(tmp_path: Path) -> None:
    """A step that loads blocks in the forward also computes the blocks after them. If the load
    missed one on any rank, that KV is wrong under the right keys: nothing computed over a block
    in doubt is saved until the workers' report of the loading step is back."""
    side, store = make(tmp_path)
    tokens = list(range(400, 417))  # 17 tokens: 4 usable blocks; the store holds the first 2
    keys = store.block_keys(tokens, "")
    assert store.try_put(keys[:2], torch.randn(2, *LAYOUT.block_shape))
    ok, bad, shared = (request(i, tokens) for i in ("ok", "bad", "shared"))
    other = request("other", list(range(500, 517)))  # another prompt: its blocks read nothing loaded
    assert side.get_num_new_matched_tokens(ok, 0) == (2 * B, False)
    side.update_state_after_alloc(ok, ([1, 2, 3, 4, 5],), 2 * B)
    assert side.get_num_new_matched_tokens(other, 0) == (0, False)
    loading = side.build_connector_meta(step(new=[("ok", [1, 2, 3, 4, 5], 2 * B, 9),
                                                 ("other", [20, 21, 22, 23, 24], 0, 17)]))
    assert [load.block_ids for load in loading.loads] == [[1, 2]]
    assert [(s.req_id, s.block_ids) for s in loading.saves] == [("other", [20, 21, 22, 23])]
    # vLLM (async scheduling) plans the next step before the loading step's output is back:
    # still in doubt, and so is a request that shares a loading block through vLLM's prefix cache
    side.get_num_new_matched_tokens(shared, 0)
    ok.all_token_ids += [7]
    nxt = side.build_connector_meta(step(new=[("shared", [1, 30, 31, 32, 33], 4, 13)], cached=[("ok", None, 17, 1)]))
    assert not nxt.saves
    worker_output(side, loading.step)  # every rank delivered: the blocks computed meanwhile are saved
    meta = side.build_connector_meta(step(cached=[("ok", None, 18, 1), ("shared", None, 17, 1)]))
    assert [(s.req_id, s.block_ids, s.keys) for s in meta.saves] == [
        ("ok", [3, 4], keys[2:4]), ("shared", [30, 31, 32], keys[1:4])]
    # A load that missed its second block: vLLM rewinds the request to it and recomputes from there.
    side.get_num_new_matched_tokens(bad, 0)
    side.update_state_after_alloc(bad, ([6, 7, 8, 9, 10],), 2 * B)
    loading = side.build_connector_meta(step(new=[("bad", [6, 7, 8, 9, 10], 2 * B, 9)]))
    assert loading.loads and not loading.saves
    worker_output(side, loading.step, invalid={7})
    meta = side.build_connector_meta(step(cached=[("bad", None, B, 13)]))  # vLLM: 1 block computed, 13 to go
    assert [(s.block_ids, s.keys) for s in meta.saves] == [([7, 8, 9], keys[1:4])]  # recomputed, then saved
    store.close()


def test_prompt_embeddings_are_neither_looked_up_nor_saved(tmp_path: Path) -> None:
    """vLLM keeps 0 for every embedding position in all_token_ids: keys of those would name every
    embeddings prompt of that length alike (and prompt_token_ids is None: no length to take)."""
    side, store = make(tmp_path)
    zeros = [0] * 13
    keys = store.block_keys(zeros, "")
    assert store.try_put(keys, torch.randn(3, *LAYOUT.block_shape))
    for r in (request("emb", zeros, embeds=True, token_ids=False), request("mixed", zeros, embeds=True)):
        assert side.get_num_new_matched_tokens(r, 0) == (0, False)
        assert not side.build_connector_meta(step(new=[(r.request_id, [1, 2, 3, 4], 0, 13)])).saves
        side.request_finished(r)
    assert side.get_num_new_matched_tokens(request("ids", zeros), 0) == (3 * B, False)  # token ids: a hit
    store.close()


def test_a_cache_salt_never_names_its_tenants_unsalted_blocks(tmp_path: Path) -> None:
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text('[[tenant]]\nname = "acme"\ntokens = ["tok-acme"]\n')
    daemon = DaemonProc(tmp_path / "data", "--tokens", str(tokens_file), "--token", "tok-admin",
                        host_mem="2MiB", disk="2MiB")
    try:
        side, store = make(tmp_path, store_url=daemon.unix, token="tok-acme")
        tokens = list(range(600, 613))
        keys = store.block_keys(tokens, "")  # the token's tenant, unsalted
        assert store.try_put(keys, torch.randn(3, *LAYOUT.block_shape))
        assert side.get_num_new_matched_tokens(request("plain", tokens), 0) == (3 * B, False)
        # a salt equal to the tenant's name once replaced it: the unsalted chain's keys
        assert side.get_num_new_matched_tokens(request("salted", tokens, salt="acme"), 0) == (0, False)
        assert side.get_num_new_matched_tokens(request("empty-salt", tokens, salt=""), 0) == (3 * B, False)
        assert side._tracked["salted"].keys != keys
        store.close()
    finally:
        daemon.stop()


def test_lora_and_multimodal_items_key_only_the_blocks_they_touch(tmp_path: Path) -> None:
    side, store = make(tmp_path)
    tokens = list(range(300, 313))
    plain = request("f", tokens)
    image = request("g", tokens, mm=[("img-1", 5, 2)])  # tokens 5-6: block 1 only
    lora = request("h", tokens, lora="adapter-x")
    moved = request("i", tokens, lora="adapter-x", lora_path="/adapters/b")  # the name re-pointed
    for r in (plain, image, lora, moved):
        side.get_num_new_matched_tokens(r, 0)
    k_plain, k_image, k_lora, k_moved = (side._tracked[i].keys for i in "fghi")
    assert k_plain is not None and k_image is not None and k_lora is not None and k_moved is not None
    assert k_image[0] == k_plain[0] and k_image[1] != k_plain[1] and k_image[2] != k_plain[2]  # chained
    assert all(a != b for a, b in zip(k_lora, k_plain, strict=True))
    assert all(a != b for a, b in zip(k_lora, k_moved, strict=True))  # vLLM keys the path too
    store.close()


def test_kv_transfer_params_say_do_not_store_and_skip_reading_asks_nothing(tmp_path: Path) -> None:
    side, store = make(tmp_path)
    tokens = list(range(700, 713))  # 3 full blocks
    keys = store.block_keys(tokens, "")
    assert store.try_put(keys[:2], torch.randn(2, *LAYOUT.block_shape))
    quiet = request("quiet", tokens)
    quiet.kv_transfer_params = {"kvstore": {"store": False}}
    assert side.get_num_new_matched_tokens(quiet, 0) == (2 * B, False)  # it still reads
    side.update_state_after_alloc(quiet, ([1, 2, 3, 4],), 2 * B)
    meta = side.build_connector_meta(step(new=[("quiet", [1, 2, 3, 4], 2 * B, 5)]))
    worker_output(side, meta.step)
    assert not side.build_connector_meta(step(cached=[("quiet", None, 13, 1)])).saves
    for bad in ({"kvstore": {"stor": False}}, {"kvstore": "no"}, {"kvstore": {"store": "false"}}):
        odd = request(f"odd-{len(side._tracked)}", list(range(800, 813)))
        odd.kv_transfer_params = bad  # not understood: read as "do not store"
        side.get_num_new_matched_tokens(odd, 0)
        assert not side.build_connector_meta(step(new=[(odd.request_id, [5, 6, 7, 8], 0, 13)])).saves
    skip = request("skip", tokens)
    skip.skip_reading_prefix_cache = True
    assert side.get_num_new_matched_tokens(skip, 0) == (0, False)
    assert side._tracked["skip"].keys is None  # not even hashed: the store was not asked
    meta = side.build_connector_meta(step(new=[("skip", [9, 10, 11, 12], 0, 13)]))
    assert [s.block_ids for s in meta.saves] == [[9, 10, 11]]  # it computed them all: saved as ever
    store.close()
