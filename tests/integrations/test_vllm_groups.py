"""The vLLM connector's hybrid-model parts that need no vLLM: vLLM's KV cache groups mapped to a
kvstore layout (identity.py), and the reconciled hit and per-group block plans (groups.py),
against a real embedded store.

vLLM is not installed in this venv: its KV cache specs are stood in for by dataclasses of the
same names and the fields identity.py reads (tests_vllm/test_connector_parts.py runs the same
mapping on vLLM's own classes).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvstore.errors import ConfigError
from kvstore.integrations.vllm.backend import GuardedStore
from kvstore.integrations.vllm.groups import GroupLookup, cold_blocks, live_start, load_blocks, reconcile
from kvstore.integrations.vllm.identity import model_identity
from kvstore.integrations.vllm.settings import ConnectorSettings
from kvstore.layout import FULL, SLIDING, KVGroup, KVLayout


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int = 32
    num_kv_heads: int = 2
    head_size: int = 32
    dtype: torch.dtype = torch.float32
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    non_causal: bool = False

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    extra_retained_tokens: int = 0


@dataclass(frozen=True)
class MambaSpec:
    block_size: int = 32


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(FullAttentionSpec):
    pass


def configs(*groups: tuple[list[str], Any]) -> tuple[Any, Any]:
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="org/gemma", revision=None),
                                  parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=spec)
                                                       for names, spec in groups])
    return vllm_config, kv_cache_config


def layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


SW = SlidingWindowSpec(sliding_window=512)
GEMMA3_270M = [([layer(g), layer(g + 6), layer(g + 12)], SW) for g in range(5)] + \
    [([layer(5), layer(11), layer(17)], FullAttentionSpec())]


def test_a_hybrid_model_maps_each_vllm_group_to_a_kvstore_group() -> None:
    ident = model_identity(*configs(*GEMMA3_270M))
    layout = ident.layout
    assert layout.num_layers == 3 and layout.is_hybrid and layout.num_groups == 6
    assert layout.groups[0] == KVGroup(SLIDING, (0, 6, 12), 512)
    assert layout.groups[5] == KVGroup(FULL, (5, 11, 17))
    assert ident.group_layers[1] == (layer(1), layer(7), layer(13))
    assert ident.layer_names[:4] == (layer(0), layer(6), layer(12), layer(1))
    assert ident.model_id == "vllm:org/gemma@-:SlidingWindowSpec+FullAttentionSpec:head32:pp1"
    assert layout.bytes_per_block == 3 * SW.page_size_bytes
    # a padded group (vLLM's grouping of 7 sliding layers to 2 full ones: 4 groups of 2 slots)
    padded = model_identity(*configs(([layer(0), layer(2)], SW), ([layer(1), layer(3)], SW),
                                     ([layer(4), layer(6)], SW), ([layer(5)], SW)))
    assert padded.layout.num_layers == 2 and padded.layout.groups[3].layers == (5,)


def test_one_full_group_keeps_todays_layout_and_a_sliding_only_model_is_one_group() -> None:
    plain = model_identity(*configs(([layer(0), layer(1)], FullAttentionSpec())))
    assert plain.layout == KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=32, dtype=torch.float32)
    assert not plain.layout.groups and plain.model_id.endswith(":FullAttentionSpec:head32:pp1")
    sliding = model_identity(*configs(([layer(0), layer(1)], SlidingWindowSpec(sliding_window=4096))))
    assert sliding.layout.groups == (KVGroup(SLIDING, (0, 1), 4096),) and sliding.layout.is_hybrid


@pytest.mark.parametrize(("group", "match"), [
    (MambaSpec(), r"Mamba or linear-attention state: KV cache spec MambaSpec \(KV cache group 1 of 2\)"),
    (ChunkedLocalAttentionSpec(attention_chunk_size=64), "spec is ChunkedLocalAttentionSpec, window 64"),
    (FullAttentionSpec(sliding_window=512), "FullAttentionSpec, window 512.*hybrid KV cache manager is off"),
    (SlidingWindowSpec(sliding_window=512, extra_retained_tokens=3), "retain 3 tokens below the window"),
    (FullAttentionSpec(non_causal=True), "non-causal"),
    (FullAttentionSpec(head_size=64), r"group 1 \(FullAttentionSpec\) differs from group 0 in head_size 64 vs 32"),
])
def test_groups_kvstore_cannot_hold_are_refused_naming_the_kind(group: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        model_identity(*configs(([layer(0)], SW), ([layer(1)], group)))
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------------- groups.py (pure)

FULL_G = KVGroup(FULL, (1,))
SLIDE_G = KVGroup(SLIDING, (0,), 48)  # 48 tokens at 16 per block: cdiv(47, 16) = 3 blocks


def holding(*held: set[int]) -> Any:
    return lambda g, i: i in held[g]


def test_reconcile_is_the_longest_boundary_every_group_serves() -> None:
    groups = (SLIDE_G, FULL_G)
    every = set(range(10))
    assert reconcile(groups, 16, 10, holding(every, every)) == 10
    assert reconcile(groups, 16, 10, holding({7, 8, 9}, every)) == 10  # only the window: enough
    # 7 missing: no boundary whose window holds it (8, 9, 10); at 7 the window (4, 5, 6) lacks 4 ...
    assert reconcile(groups, 16, 10, holding({8, 9}, every)) == 0
    assert reconcile(groups, 16, 10, holding({0, 1, 2, 8, 9}, every)) == 3  # ... down to 3, whose window is there
    assert reconcile(groups, 16, 10, holding(every, set(range(6)))) == 6  # the full group's run bounds it
    assert reconcile(groups, 16, 10, holding({0, 1, 3, 4, 5}, every)) == 6  # the window (3, 4, 5)
    assert reconcile(groups, 16, 10, holding({0, 1}, every)) == 2  # a window cut short by the start
    assert reconcile(groups, 16, 10, holding(set(), every)) == 0
    assert reconcile(groups, 16, 0, holding(every, every)) == 0


def test_reconcile_never_reports_a_hit_some_group_cannot_deliver() -> None:
    """Every boundary reconcile answers is served by every group, and none beyond it is."""
    gen = torch.Generator().manual_seed(5)
    groups = (SLIDE_G, KVGroup(SLIDING, (2,), 20), FULL_G)  # windows of 3 and 2 blocks, and full
    for _ in range(300):
        held = [{i for i in range(12) if torch.rand(1, generator=gen).item() < 0.8} for _ in groups]
        n = reconcile(groups, 16, 12, holding(*held))

        def serves(m: int, held: list[set[int]] = held) -> bool:
            return all(set(load_blocks(group, 16, 0, m)) <= held[g] for g, group in enumerate(groups))

        assert n == 0 or serves(n), (held, n)
        assert not any(serves(m) for m in range(n + 1, 13)), (held, n)


def test_block_plans_of_a_load_a_save_and_a_cooling() -> None:
    assert load_blocks(FULL_G, 16, 2, 9) == range(2, 9)
    assert load_blocks(SLIDE_G, 16, 2, 9) == range(6, 9)  # its window only
    assert load_blocks(SLIDE_G, 16, 7, 9) == range(7, 9)  # vLLM holds the rest
    # vLLM frees a sliding block once wholly below the next token's window (W - 1 tokens back)
    assert live_start(FULL_G, 16, 1000) == 0
    assert live_start(SLIDE_G, 16, 47) == 0 and live_start(SLIDE_G, 16, 64) == 1 and live_start(SLIDE_G, 16, 160) == 7
    # blocks below the window of boundary 10, except the window the request's hit at 5 used
    assert cold_blocks(SLIDE_G, 16, 0, 10, 5) == [0, 1, 5, 6]
    assert cold_blocks(SLIDE_G, 16, 6, 10, 0) == [6] and cold_blocks(SLIDE_G, 16, 7, 10, 0) == []
    assert cold_blocks(FULL_G, 16, 0, 10, 0) == []


@pytest.fixture
def store(request: pytest.FixtureRequest) -> GuardedStore:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype=torch.float32,
                      groups=(SLIDE_G, FULL_G))
    guarded = GuardedStore(ConnectorSettings.from_extra_config({"host_bytes": "1MiB"}), layout, request.node.name)
    request.addfinalizer(guarded.close)
    return guarded


def put(store: GuardedStore, keys: list[bytes], g: int, blocks: list[int]) -> None:
    gk = store.group_keys([keys[i] for i in blocks], g)
    assert store.try_put(gk, torch.randn(len(blocks), *store.layout.block_shape), g)


def test_group_lookup_asks_the_store_per_group_and_reconciles(store: GuardedStore) -> None:
    keys = store.block_keys(list(range(10 * 16)), "")
    put(store, keys, 1, list(range(10)))
    put(store, keys, 0, [0, 1, 2, 4, 5, 6, 8, 9])  # the window of 10 (7, 8, 9) lacks block 7
    found = GroupLookup(store.layout.kv_groups, 16, store, keys)
    assert found.hit(10) == 7  # the window of 7 (4, 5, 6) is all there
    assert found.num_lookups == 3  # the full group's run, then the windows of 10 and of 7
    assert found.tiers(7, 0) == ("host",) * 7
    # vLLM holds the first 8 blocks itself: the sliding window of 10 needs only 8 and 9 of the store
    assert found.hit(10, first=8) == 10 and found.tiers(10, 8) == ("",) * 8 + ("host", "host")
    # no hit beyond the keys asked about; a store without the prompt's blocks serves none
    assert GroupLookup(store.layout.kv_groups, 16, store, keys[:7]).hit(10) == 7
    assert GroupLookup(store.layout.kv_groups, 16, store, store.block_keys(list(range(999, 1100)), "")).hit(6) == 0
