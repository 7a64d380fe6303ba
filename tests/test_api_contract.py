"""One contract suite, run against every BlockStore: embedded, a daemon connection, and the
vLLM connector's guard over each. What the contract says is in kvstore/api.py."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemon.daemon_helpers import LAYOUT, DaemonProc, blocks, prompt

from kvstore import BlockStore, LayoutMismatchError, StoreConfig, TieredStore
from kvstore.api import KeyChain
from kvstore.client.client import StoreClient
from kvstore.integrations.vllm.backend import GuardedStore
from kvstore.integrations.vllm.settings import ConnectorSettings
from kvstore.keys import BlockHasher, Namespace

from waiting import wait_until

MODEL = "test-model"
KINDS = ("embedded", "daemon", "guarded-embedded", "guarded-daemon")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    proc = DaemonProc(tmp_path_factory.mktemp("contract") / "data", host_mem="4MiB", disk="0")
    yield proc
    if proc.proc.poll() is None:
        proc.kill9()


def open_store(kind: str, daemon: DaemonProc, tmp_path: Path) -> BlockStore:
    if kind == "embedded":
        return TieredStore(StoreConfig(layout=LAYOUT, model_id=MODEL, host_bytes=1 << 20))
    if kind == "daemon":
        return daemon.connect(model_id=MODEL)
    where = daemon.unix if kind == "guarded-daemon" else "embedded"
    guard = GuardedStore(ConnectorSettings.from_extra_config({"store_url": where, "host_bytes": "1MiB",
                                                              "disk_path": str(tmp_path / "disk"), "disk_bytes": "1MiB"}),
                         LAYOUT, MODEL)
    assert guard.is_up
    return guard


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, daemon: DaemonProc, tmp_path: Path) -> Iterator[BlockStore]:
    opened = open_store(request.param, daemon, tmp_path)
    yield opened
    opened.close()


_SALTS = itertools.count(1000)


def fresh(n: int) -> list[int]:
    """Tokens no other call puts (the daemon's namespace lives for the whole module)."""
    return prompt(next(_SALTS), n)


# ------------------------------------------------------------------------------ signatures


def contract_methods() -> list[str]:
    return sorted(n for n, v in vars(BlockStore).items() if inspect.isfunction(v) and not n.startswith("_"))


@pytest.mark.parametrize("impl", [TieredStore, StoreClient, GuardedStore], ids=lambda c: c.__name__)
def test_every_store_takes_the_contract_arguments_in_the_contract_order(impl: type) -> None:
    methods = [*contract_methods(), "block_keys", "group_keys"]
    assert {"put", "lookup", "get", "fetch", "contains", "delete", "pin", "unpin", "stats", "flush",
            "close", "prefetch", "inspect"} <= set(methods)
    for name in methods:
        want = list(inspect.signature(getattr(BlockStore, name) if name not in ("block_keys", "group_keys")
                                      else getattr(KeyChain, name)).parameters.values())
        have = list(inspect.signature(getattr(impl, name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in have[: len(want)]] == \
               [(p.name, p.kind, p.default) for p in want], f"{impl.__name__}.{name}"
        extra = have[len(want):]  # an implementation may add keyword-only options with defaults
        assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra), f"{impl.__name__}.{name}"


def test_the_key_hasher_is_a_key_chain() -> None:
    assert isinstance(BlockHasher(Namespace(MODEL, LAYOUT)), KeyChain)


# ------------------------------------------------------------------------------ behaviour


def test_is_a_block_store_of_the_model_namespace(store: BlockStore) -> None:
    assert isinstance(store, BlockStore)
    assert store.layout == LAYOUT
    assert store.namespace.id == Namespace(MODEL, LAYOUT).id


def test_keys_chain_and_a_tenant_salts_them(store: BlockStore) -> None:
    tokens = fresh(4)
    keys = store.block_keys(tokens)
    assert len(keys) == 4 and len(set(keys)) == 4
    split = 2 * LAYOUT.block_size
    assert store.block_keys(tokens[split:], parent=keys[1]) == keys[2:]
    assert store.block_keys([*tokens, 7]) == keys  # a partial block has no key
    acme = store.block_keys(tokens, "acme")
    assert acme == store.block_keys(tokens, tenant="acme") and not set(acme) & set(keys)
    assert store.block_keys(tokens, extra_keys=[None, ["lora-a"], None, None])[1:] != keys[1:]


def test_a_put_is_looked_up_and_read_back_bit_for_bit(store: BlockStore) -> None:
    keys = store.block_keys(fresh(3))
    data = blocks(keys)
    assert store.lookup(keys).num_blocks == 0
    store.put(keys, data)
    assert store.flush(10)
    match = store.lookup(keys)
    assert match.num_blocks == 3 and len(match.tiers) == 3
    assert torch.equal(store.get(keys), data)
    out = torch.empty_like(data)
    assert store.get(keys[1:], out[1:]) is not None and torch.equal(out[1:], data[1:])
    assert store.contains(keys) == [True, True, True]


def test_a_lookup_stops_at_the_first_block_not_held(store: BlockStore) -> None:
    keys = store.block_keys(fresh(4))
    store.put(keys[:2], blocks(keys[:2]))
    store.flush(10)
    assert store.lookup(keys).num_blocks == 2
    assert store.contains(keys) == [True, True, False, False]
    with pytest.raises(KeyError):
        store.get(keys)


def test_a_fetch_copies_the_leading_run_in_the_background(store: BlockStore) -> None:
    keys = store.block_keys(fresh(3))
    data = blocks(keys)
    store.put(keys[:2], data[:2])
    store.flush(10)
    into = torch.zeros_like(data)
    result = store.fetch(keys, into).result(30)
    assert result.num_blocks == 2 and len(result.tiers) == 2
    assert torch.equal(into[:2], data[:2]) and not into[2].any()


def test_a_tenants_blocks_are_its_own(store: BlockStore) -> None:
    tokens = fresh(2)
    mine, theirs = store.block_keys(tokens, "acme"), store.block_keys(tokens, "globex")
    store.put(mine, blocks(mine), tenant="acme")
    store.flush(10)
    assert store.lookup(mine).num_blocks == 2 and store.lookup(theirs).num_blocks == 0


def test_delete_drops_what_is_held_and_counts_it(store: BlockStore) -> None:
    keys = store.block_keys(fresh(3))
    store.put(keys[:2], blocks(keys[:2]))
    store.flush(10)
    assert store.delete(keys) == 2
    assert store.contains(keys) == [False, False, False] and store.lookup(keys).num_blocks == 0


def test_a_pinned_block_is_kept_and_unpin_lets_it_go(store: BlockStore) -> None:
    keys = store.block_keys(fresh(1))
    store.put(keys, blocks(keys))
    store.flush(10)
    store.pin(keys)
    # more blocks than the host tier holds (1 MiB embedded, a 4 MiB daemon's share): the pinned one stays
    for _ in range(12):
        more = store.block_keys(fresh(256))
        store.put(more, blocks(more))
    store.flush(10)
    assert store.contains(keys) == [True]
    store.unpin(keys)


def test_cool_counts_the_blocks_held_and_keeps_them_readable(store: BlockStore) -> None:
    keys = store.block_keys(fresh(2))
    store.put(keys, blocks(keys))
    store.flush(10)
    assert store.cool([*keys, *store.block_keys(fresh(1))]) == 2  # one never put: skipped
    assert store.contains(keys) == [True, True] and (store.get(keys) == blocks(keys)).all()
    assert store.group_keys(keys, 0) == keys  # one KV group: the chain's keys
    with pytest.raises(IndexError, match="group 1 is not one of the layout's 1 KV groups"):
        store.group_keys(keys, 1)


def test_a_pin_with_a_ttl_ends_by_itself_and_a_bad_one_is_refused(store: BlockStore) -> None:
    keys = store.block_keys(fresh(1))
    store.put(keys, blocks(keys))
    store.flush(10)
    with pytest.raises(ValueError, match="ttl_s must be"):
        store.pin(keys, ttl_s=0)
    store.pin(keys, ttl_s=0.5)
    info = store.inspect(keys)[0]
    assert info is not None and info.pins == 1 and info.pin_expires_s is not None
    wait_until(lambda: store.inspect(keys)[0].pins == 0, 10, "the pin's TTL")  # type: ignore[union-attr]


def test_prefetch_answers_at_once_with_a_handle_and_refuses_too_many_keys(store: BlockStore) -> None:
    keys = store.block_keys(fresh(2))
    store.put(keys, blocks(keys))
    store.flush(10)
    handle = store.prefetch([*keys, *store.block_keys(fresh(1))])
    assert handle.result(30) == 2 and handle.done() and handle.num_requested == 3
    with pytest.raises(ValueError, match="at most 65536 keys"):
        store.prefetch(keys[:1] * 10_000_000)


def test_inspect_says_where_each_block_is(store: BlockStore) -> None:
    keys = store.block_keys(fresh(2))
    store.put(keys[:1], blocks(keys[:1]))
    store.flush(10)
    found, missing = store.inspect(keys)
    assert missing is None and found is not None and found.key == keys[0]
    assert "host" in found.tiers and found.codecs["host"] == "none" and found.stored_bytes["host"] > 0


def test_delete_with_descendants_takes_the_chain_below(store: BlockStore) -> None:
    keys = store.block_keys(fresh(4))
    store.put(keys, blocks(keys))
    store.flush(10)
    assert store.delete(keys[1:2], descendants=True) == 3
    assert store.contains(keys) == [True, False, False, False]


def test_stats_are_counters_per_tier(store: BlockStore) -> None:
    keys = store.block_keys(fresh(1))
    store.put(keys, blocks(keys))
    store.get(keys)
    stats = store.stats()
    assert "host" in stats and all(isinstance(row, dict) for row in stats.values())


def test_blocks_of_the_wrong_shape_are_refused(store: BlockStore) -> None:
    keys = store.block_keys(fresh(2))
    with pytest.raises(LayoutMismatchError):
        store.put(keys, torch.zeros(2, 3))
    with pytest.raises(LayoutMismatchError):
        store.put(keys, blocks(keys).to(torch.float16))
    with pytest.raises(LayoutMismatchError):
        store.fetch(keys, torch.zeros(2, 3))
    assert store.contains(keys) == [False, False]


# ------------------------------------------------------------------------------ the guard's part


def test_the_guard_turns_a_dead_daemon_into_misses(tmp_path: Path) -> None:
    """The one place the implementations differ: GuardedStore never raises a store failure."""
    proc = DaemonProc(tmp_path / "data", disk="0")
    guard = GuardedStore(ConnectorSettings(store_url=proc.unix, retry_s=60), LAYOUT, MODEL)
    try:
        keys = guard.block_keys(prompt(1, 2))
        guard.put(keys, blocks(keys))
        assert guard.flush(10) and guard.lookup(keys).num_blocks == 2
        proc.kill9()
        assert guard.lookup(keys).num_blocks == 0 or not guard.is_up  # the dead socket may answer once
        guard.put(keys, blocks(keys))  # dropped, not raised
        assert guard.contains(keys) == [False, False] and guard.delete(keys) == 0
        assert guard.fetch(keys, torch.zeros(2, *LAYOUT.block_shape)).result(30).num_blocks == 0
        with pytest.raises(KeyError):
            guard.get(keys)
        assert not guard.is_up and guard.failures >= 1
        assert guard.stats() == {} and guard.flush(1) is False
    finally:
        guard.close()
