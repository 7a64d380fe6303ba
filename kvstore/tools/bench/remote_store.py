"""The rows of ``kvstore bench remote`` that time the remote tier as users call it: through a
``TieredStore`` (``promotion="never"``, so every read goes to the cluster).

- a warm store's ``fetch(keys, into=)``, ``get`` and ``lookup`` + ``fetch`` (the engine's
  path) of 64 x 192 KiB blocks only the cluster holds;
- the first fetch of a fresh store: the slot map's discovery and the connections included;
- a lookup of a prefix the cluster does not hold, once its hint is warm (its round trips
  counted in ``stats()["remote"]``);
- what decided a lookup's command: lookup + fetch of 1 to 64 blocks with the lookup asking
  EXISTS, or GETting and keeping the values for the fetch.

The baselines are redis-py's cluster pipeline GET of the same bytes alone (the raw GET: its
values left as the ``bytes`` it made), and the same plus one ``copy_`` of each value into a
tensor, which a caller needs as ours delivers (a fresh ``RedisCluster`` client for the fresh
store's row). Rounds
interleave ours and the baseline, the order reversed every other round.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from kvstore.config import StoreConfig
from kvstore.store import TieredStore
from kvstore.tiers.remote import RemoteTier
from kvstore.tools.bench.harness import BENCH_LAYOUT, Row

NUM_BLOCKS = 64
LOOKUP_RUNS = (1, 4, 16, 64)
Timings = list[list[float]]


def interleave(fns: list[Callable[[], object]], rounds: int, before: Callable[[], object] | None = None) -> Timings:
    """Every round runs each function once, in turn (the order reversed every other round,
    so neither side always goes first); all times per function, by round. ``before`` runs
    untimed ahead of each call."""
    times: Timings = [[] for _ in fns]
    for r in range(rounds):
        order = list(range(len(fns)))
        for i in order if r % 2 == 0 else order[::-1]:
            if before is not None:
                before()
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    return times


def paired_ratio(base: list[float], ours: list[float]) -> float:
    """Median over rounds of base/ours, each pair measured back to back (robust to load)."""
    ratios = sorted(b / o for b, o in zip(base, ours, strict=True))
    return ratios[len(ratios) // 2]


def parser() -> str:
    """Which parser redis-py reads replies with here: hiredis (C) when installed, else its own."""
    from redis.utils import HIREDIS_AVAILABLE

    return "hiredis" if HIREDIS_AVAILABLE else "its pure-Python parser (hiredis not installed)"


def spread(times: list[float]) -> float:
    """Median over best, in per cent."""
    return (sorted(times)[len(times) // 2] / min(times) - 1) * 100


class Baseline:
    """redis-py's cluster client holding the same payloads under names of its own (no hash
    tag: they spread over the primaries as ours do)."""

    def __init__(self, seeds: list[int], rows: torch.Tensor, tag: str) -> None:
        from redis.cluster import ClusterNode
        from redis.cluster import RedisCluster as PyCluster

        self.startup = [ClusterNode("127.0.0.1", p) for p in seeds]
        self.client = PyCluster(startup_nodes=self.startup)
        self.names = [f"base:{tag}:{i}" for i in range(len(rows))]
        pipe = self.client.pipeline()
        for name, row in zip(self.names, rows, strict=True):
            pipe.set(name, bytes(row.numpy()))
        pipe.execute()

    def get(self, out: torch.Tensor, client: Any = None) -> None:
        """Pipelined GET, then one ``copy_`` of each value into its row of ``out``."""
        pipe = (client or self.client).pipeline()
        for name in self.names:
            pipe.get(name)
        for i, value in enumerate(pipe.execute()):
            out[i].copy_(torch.frombuffer(value, dtype=torch.uint8))

    def get_raw(self) -> None:
        """Pipelined GET alone: the values stay redis-py's ``bytes`` (no copy anywhere)."""
        pipe = self.client.pipeline()
        for name in self.names:
            pipe.get(name)
        pipe.execute()

    def exists(self, names: list[str]) -> None:
        pipe = self.client.pipeline()
        for name in names:
            pipe.exists(name)
        pipe.execute()

    def fresh_get(self, out: torch.Tensor) -> None:
        """A new client (its discovery of the cluster), then ``get``."""
        from redis.cluster import RedisCluster as PyCluster

        client = PyCluster(startup_nodes=self.startup)
        try:
            self.get(out, client)
        finally:
            client.close()

    def close(self) -> None:
        self.client.close()


def bench_store(url: str, seeds: list[int], repeat: int) -> tuple[list[Row], dict[str, Any]]:
    """The store rows, and their spreads, paired ratios and round-trip counts."""
    warnings.filterwarnings("ignore", message="The given buffer is not writable")  # frombuffer(bytes): read only
    layout, n = BENCH_LAYOUT, NUM_BLOCKS
    payload = layout.bytes_per_block
    blocks = torch.randn((n, *layout.block_shape)).to(layout.dtype)
    rows_in = blocks.view(torch.uint8).reshape(n, payload)
    config = StoreConfig(layout=layout, model_id=f"bench-remote-store-{time.time()}", host_bytes=8 * payload,
                         remote_url=url, promotion="never", remote_timeout_s=5.0)
    with TieredStore(config) as writer:
        keys = writer.block_keys(list(range(n * layout.block_size)))
        writer.put(keys, blocks)
        if not writer.flush(60):
            raise RuntimeError("the remote tier did not take the blocks within 60 s")
    base = Baseline(seeds, rows_in, f"store-{time.time()}")
    into = torch.empty_like(blocks)
    out = torch.empty_like(rows_in)
    store = TieredStore(config)
    try:
        def fetch() -> None:
            assert store.fetch(keys, into=into).result().num_blocks == n, "a warm store missed a block"

        def get() -> None:
            store.get(keys, out=into)

        def lookup_fetch() -> None:
            assert store.lookup(keys).num_blocks == n
            fetch()

        fetch()  # warm: slot map, connections, hints
        times = interleave([fetch, get, lookup_fetch, lambda: base.get(out), base.get_raw], repeat)
        assert torch.equal(into, blocks) and torch.equal(out, rows_in), "a read returned other bytes"
        fresh_s, fresh_base_s = bench_fresh(config, keys, into, base, out, repeat)
        miss_s, miss_base_s, miss_trips = bench_warm_miss(store, base, repeat)
        lookups = bench_lookup_runs(store, keys, into, repeat)
    finally:
        store.close()
        base.close()
    fetch_s, get_s, lookup_fetch_s, base_s, raw_s = times
    size = f"{n} x {payload // 1024} KiB"
    baseline = "redis-py cluster pipeline GET + copy_"
    rows = [
        Row(f"store fetch(into=), warm store, {size}, against the raw GET", min(fetch_s), min(raw_s),
            "redis-py cluster pipeline GET, values left as its bytes (no copy)", ">= 0.9x"),
        Row(f"store fetch(into=), warm store, {size}", min(fetch_s), min(base_s), baseline, ">= 0.9x"),
        Row(f"store get, warm store, {size}", min(get_s), min(base_s), baseline, ">= 0.9x"),
        Row(f"store lookup + fetch (the engine's path), warm store, {size}", min(lookup_fetch_s), min(base_s),
            baseline, ">= 0.9x"),
        Row(f"first fetch of a fresh store (slot map and connections included), {size}", min(fresh_s),
            min(fresh_base_s), "a new redis-py RedisCluster + pipeline GET + copy_", ">= 0.7x"),
        Row(f"lookup of a remote miss, hint warm, {n} blocks", min(miss_s), min(miss_base_s),
            "redis-py cluster pipeline EXISTS", ">= 1x", "speedup"),
    ]
    detail: dict[str, Any] = {
        "spread": {"fetch": spread(fetch_s), "get": spread(get_s), "lookup_fetch": spread(lookup_fetch_s),
                   "base": spread(base_s), "raw": spread(raw_s), "fresh": spread(fresh_s),
                   "fresh_base": spread(fresh_base_s)},
        "paired": {"fetch": paired_ratio(base_s, fetch_s), "fetch_raw": paired_ratio(raw_s, fetch_s),
                   "get": paired_ratio(base_s, get_s),
                   "lookup_fetch": paired_ratio(base_s, lookup_fetch_s),
                   "fresh": paired_ratio(fresh_base_s, fresh_s)},
        "parser": parser(), "miss_round_trips": miss_trips, "miss_lookups": len(miss_s), "lookup_runs": lookups,
    }
    return rows, detail


def bench_fresh(config: StoreConfig, keys: list[bytes], into: torch.Tensor, base: Baseline, out: torch.Tensor,
                repeat: int) -> tuple[list[float], list[float]]:
    """The first fetch of a store opened just before (untimed: it asks no node), against a
    new redis-py client's discovery and its pipeline GET."""
    ours: list[float] = []
    theirs: list[float] = []
    for r in range(max(3, repeat // 3)):
        for side in ("ours", "base") if r % 2 == 0 else ("base", "ours"):
            if side == "base":
                t0 = time.perf_counter()
                base.fresh_get(out)
                theirs.append(time.perf_counter() - t0)
                continue
            with TieredStore(config) as store:
                t0 = time.perf_counter()
                got = store.fetch(keys, into=into).result()
                ours.append(time.perf_counter() - t0)
            assert got.num_blocks == len(keys), "a fresh store missed a block"
    return ours, theirs


def bench_warm_miss(store: TieredStore, base: Baseline, repeat: int) -> tuple[list[float], list[float], int]:
    """A lookup of a prefix nobody wrote, its hint warm, vs one EXISTS pipeline; the round
    trips the store made for those lookups (the target: none)."""
    missing = store.block_keys(list(range(10**6, 10**6 + NUM_BLOCKS * store.layout.block_size)))
    assert store.lookup(missing).num_blocks == 0  # asked once: the hint is warm now
    before = store.stats()["remote"]["round_trips"]
    names = [f"missing:{i}" for i in range(NUM_BLOCKS)]
    ours, theirs = interleave([lambda: store.lookup(missing), lambda: base.exists(names)], repeat)
    return ours, theirs, store.stats()["remote"]["round_trips"] - before


def bench_lookup_runs(store: TieredStore, keys: list[bytes], into: torch.Tensor, repeat: int) -> list[dict[str, Any]]:
    """Lookup + fetch of a cold run of 1 to 64 blocks (hints cleared before each round), the
    lookup asking EXISTS or GETting the run and keeping its values for the fetch: the lookup's
    own time and the pair's."""
    tier: RemoteTier = store.level("remote").tier  # type: ignore[union-attr]
    default = tier.lookup_get_bytes
    found = []
    try:
        for k in LOOKUP_RUNS:
            run, dst = keys[:k], into[:k]
            spent: dict[str, list[float]] = {"exists": [], "get": []}

            def pair(mode: str, run: list[bytes] = run, dst: torch.Tensor = dst,
                     spent: dict[str, list[float]] = spent) -> None:
                tier.lookup_get_bytes = 0 if mode == "exists" else 1 << 40
                t0 = time.perf_counter()
                assert store.lookup(run).num_blocks == len(run)
                spent[mode].append(time.perf_counter() - t0)
                assert store.fetch(run, into=dst).result().num_blocks == len(run)

            def cold() -> None:
                tier.hints.clear()
                tier.kept.drop(keys)

            times = interleave([lambda: pair("exists"), lambda: pair("get")], repeat, before=cold)
            found.append({"blocks": k, "exists_lookup_s": min(spent["exists"]), "exists_pair_s": min(times[0]),
                          "get_lookup_s": min(spent["get"]), "get_pair_s": min(times[1])})
    finally:
        tier.lookup_get_bytes = default
    return found


def render_store(detail: dict[str, Any]) -> list[str]:
    """The lines after the table: spreads, paired ratios, round trips, the lookup table."""
    s, p = detail["spread"], detail["paired"]
    lines = [
        f"Store rows, spread (median over best, %): fetch {s['fetch']:.0f}, get {s['get']:.0f}, lookup + fetch "
        f"{s['lookup_fetch']:.0f}, baseline GET + copy_ {s['base']:.0f}, raw GET {s['raw']:.0f}; fresh store "
        f"{s['fresh']:.0f}, fresh baseline {s['fresh_base']:.0f}. Median of the per-round ratios (each pair "
        f"back to back): fetch {p['fetch']:.2f}x (against the raw GET {p['fetch_raw']:.2f}x), get "
        f"{p['get']:.2f}x, lookup + fetch {p['lookup_fetch']:.2f}x, fresh store {p['fresh']:.2f}x. redis-py "
        f"parses replies with {detail['parser']}.",
        "",
        f"Round trips of {detail['miss_lookups']} lookups of a remote miss once its hint was warm: "
        f"{detail['miss_round_trips']} (`stats()[\"remote\"][\"round_trips\"]`).",
        "",
        "A lookup's command, measured (cold hints; best of the rounds): the lookup asking EXISTS and "
        "the fetch then GETting, against the lookup GETting the run and keeping its values for the "
        "fetch. The store GETs at lookup up to 1 MiB of values (`LOOKUP_GET_BYTES`): past that the "
        "transfer lands on the looking-up thread (an engine's scheduler, vLLM's) and is wasted when no "
        "fetch follows.",
        "",
        "| blocks | lookup by EXISTS | lookup by EXISTS, then fetch | lookup by GET, values kept | "
        "lookup by GET, then fetch from the kept values |",
        "|---|---|---|---|---|",
    ]
    for r in detail["lookup_runs"]:
        lines.append(f"| {r['blocks']} | {r['exists_lookup_s'] * 1e3:.2f} ms | {r['exists_pair_s'] * 1e3:.2f} ms "
                     f"| {r['get_lookup_s'] * 1e3:.2f} ms | {r['get_pair_s'] * 1e3:.2f} ms |")
    return lines
