"""kvstore replay: hit accounting, the cascade, Belady, the CLI's output and its errors."""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.tools import replay as rp
from kvstore.tools.replay.estimate import CostModel, estimate, measured_gbps
from kvstore.tools.replay.workloads import write_trace as write_workload

from factories import require

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


def write_trace(path: Path, requests: list[list[int]]) -> Path:
    path.write_text("".join(
        json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}) + "\n"
        for i, ids in enumerate(requests)))
    return path


def hits(path: Path, policy: str, *caps: int) -> rp.ReplayResult:
    tiers = [rp.TierSpec(name, c) for name, c in zip(("device", "host", "disk"), caps, strict=False)]
    return rp.replay(rp.load_trace(path), tiers, policy)


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="kvstore")
    rp.register(parser.add_subparsers())
    try:
        args = parser.parse_args(["replay", *argv])
        code = args.func(args)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------- hit accounting


def test_hit_ratio_counts_the_leading_run_of_found_blocks(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [6], [5]])
    for policy in ("lru", "reuse", "belady"):  # nothing is evicted: every policy agrees
        result = hits(path, policy, 100)
        # 0 + 2 (1,2) + 3 (1,2,3) + 0 + 0: id 5 at the root is another prefix than 5 after 1,2,3
        assert (result.hits, result.prompt_blocks) == (5, 12)
        assert result.hit_ratio == pytest.approx(5 / 12)


def test_requests_longer_than_the_tier_are_cut_and_tails_evicted_first(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[1, 2, 3], [1, 2, 3], [7, 8], [1, 2]])
    result = hits(path, "lru", 2)
    # [1,2,3] caches 1,2 (cut to 2 blocks); again: 2 hits; [7,8] evicts 2 then 1; [1,2]: 0.
    assert result.hits == 2 and result.dropped_blocks == 4
    path = write_trace(tmp_path / "u.jsonl", [[1, 2], [3, 4], [1, 2]])
    assert hits(path, "lru", 3).hits == 1  # [3,4] needed one slot: block 2 (the tail) left


def test_cascade_counts_hits_by_tier_and_moves(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[1, 2], [3, 4], [5, 6], [1, 2], [3, 4], [1, 2], [1, 2]])
    result = hits(path, "lru", 2, 2, 10)
    # r2 demotes A to host; r3 pushes A to disk, B to host; r4 hits A on disk (C->host, B->disk);
    # r5 hits B on disk (A->host, C->disk); r6 hits A in host; r7 hits A on the device.
    assert result.hits_by_tier == {"device": 2, "host": 2, "disk": 4}
    assert result.read_blocks == {"device": 0, "host": 2, "disk": 4}
    assert result.written_blocks == {"device": 0, "host": 10, "disk": 6}
    assert result.dropped_blocks == 0


# ----------------------------------------------------------------------------- Belady


def test_belady_hand_computed_paging_case(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[1], [2], [3], [1], [2], [4], [1], [2]])
    assert hits(path, "belady", 2).hits == 2  # keeps 1 over 2, then 1 over 3 and 4
    assert hits(path, "lru", 2).hits == 0


def brute_force_hits(requests: list[int], capacity: int) -> int:
    """The best number of hits over every eviction choice (single-block requests)."""
    best: dict[tuple[int, frozenset[int]], int] = {}

    def go(i: int, cache: frozenset[int]) -> int:
        if i == len(requests):
            return 0
        if (i, cache) not in best:
            key = requests[i]
            if key in cache:
                best[(i, cache)] = 1 + go(i + 1, cache)
            elif len(cache) < capacity:
                best[(i, cache)] = go(i + 1, cache | {key})
            else:
                best[(i, cache)] = max(go(i + 1, cache - {v} | {key}) for v in cache)
        return best[(i, cache)]

    return go(0, frozenset())


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(st.integers(0, 5), min_size=1, max_size=14), capacity=st.integers(1, 3))
def test_belady_is_optimal_on_single_block_requests(tmp_path_factory: pytest.TempPathFactory,
                                                    requests: list[int], capacity: int) -> None:
    path = write_trace(tmp_path_factory.mktemp("b") / "t.jsonl", [[r] for r in requests])
    assert hits(path, "belady", capacity).hits == brute_force_hits(requests, capacity)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), capacity=st.integers(3, 12))
def test_belady_never_loses_to_the_online_policies(tmp_path_factory: pytest.TempPathFactory,
                                                   seed: int, capacity: int) -> None:
    rng = random.Random(seed)
    convs = [[rng.randrange(1000) for _ in range(rng.randint(1, 6))] for _ in range(6)]
    requests = []
    for _ in range(40):  # conversations grow a block now and then, and come back
        conv = rng.choice(convs)
        if rng.random() < 0.3:
            conv.append(rng.randrange(1000, 10**6))
        requests.append(list(conv))
    path = write_trace(tmp_path_factory.mktemp("c") / "t.jsonl", requests)
    best = hits(path, "belady", capacity).hits
    assert best >= hits(path, "lru", capacity).hits
    assert best >= hits(path, "reuse", capacity).hits


# ----------------------------------------------------------------------------- the command line


def test_json_output_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[1, 2, 3], [1, 2], [4, 5], [1, 2, 3, 6], [4, 5]])
    code, out, err = cli([str(path), "--capacity", "3,5", "--capacity", "4", "--json"], capsys)
    assert code == 0 and err == ""  # not a TTY: no progress bar
    data = json.loads(out)
    assert (data["requests"], data["prompt_blocks"]) == (5, 13)
    results = data["results"]
    assert [(r["policy"], r["capacity_blocks"]) for r in results] == [
        (p, c) for c in (3, 4, 5) for p in ("reuse", "lru", "belady")]
    assert [r["default"] for r in results[:3]] == [True, False, False]
    for r in results:
        assert r["hits_by_tier"].keys() == {"device"} and 0 <= r["hit_ratio"] <= 1
        assert r["hit_ratio"] == pytest.approx(r["hits"] / 13)
        assert {"bytes_read_by_tier", "prefill_seconds_saved", "replay_seconds"} <= r.keys()


def test_table_cascade_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[1, 2], [3, 4], [5, 6], [1, 2]])
    code, out, _ = cli([str(path), "--device", "2", "--host", "2", "--disk", "8", "--policy", "lru"], capsys)
    assert code == 0 and "device hits" in out and "disk hits" in out and "GB moved" in out
    png = tmp_path / "p.png"
    code, out, _ = cli([str(path), "--capacity", "2,4", "--plot", str(png), "--quiet"], capsys)
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG" and "reuse*" in out


@pytest.mark.parametrize(("lines", "args", "message"), [
    (None, [], "trace file not found"),
    (['{"hash_ids": [1]}', "{oops"], [], "line 2: invalid JSON"),
    (['{"input_length": 3}'], [], "line 1: missing field 'hash_ids'"),
    (['{"hash_ids": [1, -2]}'], [], "line 1: 'hash_ids' must be a list of integers"),
    (['[1, 2]'], [], "line 1: expected a JSON object"),
    # found by the trace fuzz harness (fuzz/regressions/trace/): a RecursionError, a UnicodeEncodeError
    (['{"hash_ids": [1]}', "[" * 3000 + "]" * 3000], [], "line 2: invalid JSON (nested too deeply)"),
    (['{"hash_ids": [1], "tenant": "\\ud800"}'], [], "line 1: 'tenant' must be a string"),
    ([""], [], "holds no requests"),
    (['{"hash_ids": [1]}'], ["--capacity", "-5"], "must be a positive int"),
    (['{"hash_ids": [1]}'], ["--capacity", "10,x"], "must be a positive int"),
    (['{"hash_ids": [1]}'], ["--capacity", "4", "--device", "4"], "not both"),
    (['{"hash_ids": [1]}'], ["--policy", "fifo"], "invalid choice: 'fifo'"),
])
def test_bad_input_is_a_clear_error_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str] | None, args: list[str], message: str,
) -> None:
    path = tmp_path / "t.jsonl"
    if lines is not None:
        path.write_text("\n".join(lines) + "\n")
    args = args if "--capacity" in args or "--device" in args else [*args, "--capacity", "4"]
    code, out, err = cli([str(path), *args], capsys)
    assert code == 2 and message in err and "Traceback" not in err and out == ""
    code, _, err = cli([str(path)], capsys)  # no capacity at all
    assert code == 2


def test_cost_model_and_measured_bandwidths(tmp_path: Path) -> None:
    model = CostModel()
    assert model.block_bytes == 64 << 20 and model.recompute_seconds == pytest.approx(0.0512)
    result = rp.ReplayResult("x", (), 1, 10, 4, {"device": 1, "host": 2, "disk": 1},
                             {"device": 0, "host": 2, "disk": 1}, {"device": 0, "host": 3, "disk": 0})
    out = estimate(result, model)
    host_saved = 0.0512 - (64 << 20) / 20e9
    disk_saved = 0.0512 - (64 << 20) / 3e9
    assert out["prefill_seconds_saved"] == pytest.approx(0.0512 + 2 * host_saved + disk_saved)
    assert out["bytes_written_by_tier"] == {"device": 0, "host": 3 * (64 << 20), "disk": 0}
    assert estimate(result, CostModel(disk_gbps=0.1))["prefill_seconds_saved_by_tier"]["disk"] == 0.0
    bench = tmp_path / "bench_tiers.json"
    bench.write_text('{"host_read_gbps": 11.5, "disk_read_gbps": "fast"}')
    assert measured_gbps(bench) == {"host": 11.5}
    bench.write_text("not json")
    assert measured_gbps(bench) == {} and measured_gbps(tmp_path / "absent.json") == {}


# ----------------------------------------------------------------------------- other workloads


@pytest.mark.parametrize("workload", ["zipf", "scan"])
def test_default_is_not_worse_than_lru_off_its_tuning(tmp_path: Path, workload: str) -> None:
    path = tmp_path / f"{workload}.jsonl"
    write_workload(workload, path, num_requests=3000)
    trace = rp.load_trace(path)
    for capacity in (300, 3000):
        tiers = [rp.TierSpec("device", capacity)]
        assert rp.replay(trace, tiers, "reuse").hits >= rp.replay(trace, tiers, "lru").hits


def test_real_trace_slice(tmp_path: Path) -> None:
    source = TRACES / "conversation_trace.jsonl"
    require(source.exists(), f"shared traces not found at {TRACES} (the repo's parent holds shared/ in CI)")
    with source.open() as f:
        lines = list(itertools.islice(f, 3000))
    path = tmp_path / "slice.jsonl"
    path.write_text("".join(lines))
    trace = rp.load_trace(path)
    for capacity, gain in ((300, 1.0), (2000, 1.5)):  # measured: 1.01x and 1.89x
        tiers = [rp.TierSpec("device", capacity)]
        lru, reuse, best = (rp.replay(trace, tiers, p).hit_ratio for p in ("lru", "reuse", "belady"))
        assert best >= reuse >= gain * lru, (capacity, lru, reuse, best)


# ----------------------------------------------------------------------------- tenants, quotas, admission


def test_derived_tenants_are_deterministic_per_conversation(tmp_path: Path) -> None:
    # every request opens with id 0 (a shared system prompt): the conversation is the next id
    requests = [[0, 10, 11], [0, 20], [0, 10, 11, 12], [0, 30, 31], [0, 20, 21]]
    path = write_trace(tmp_path / "t.jsonl", requests)
    trace = rp.load_trace(path, tenants=3)
    again = rp.load_trace(path, tenants=3)
    assert trace.tenants == again.tenants and len(trace.tenants) == 5
    assert trace.tenants[0] == trace.tenants[2] and trace.tenants[1] == trace.tenants[4]
    assert set(trace.tenants) <= {"t0", "t1", "t2"}
    # salted per tenant: the shared id 0 is a separate block of each tenant
    roots = {trace.chains[i][0] for i in range(5)}
    assert len(roots) == len(set(trace.tenants))
    assert all(trace.owners[trace.chains[i][0]] == trace.tenants[i] for i in range(5))
    named = tmp_path / "named.jsonl"
    named.write_text('{"hash_ids": [1], "tenant": "x"}\n')
    with pytest.raises(rp.ReplayError, match="names its tenants"):
        rp.load_trace(named, tenants=2)
    named.write_text('{"hash_ids": [1], "tenant": 7}\n')
    with pytest.raises(rp.ReplayError, match="'tenant' must be a string"):
        rp.load_trace(named)


def test_replay_with_quotas_shields_the_hot_tenant_from_the_flood(tmp_path: Path) -> None:
    from kvstore.policy.quotas import Limit, QuotaTable, TierQuota

    path = tmp_path / "flood.jsonl"
    write_workload("flood", path, num_requests=3000)
    trace = rp.load_trace(path)
    assert trace.tenant_names == ["flood", "hot"]
    tiers = [rp.TierSpec("host", 200)]
    free = rp.replay(trace, tiers, "lru")
    equal = rp.replay(trace, tiers, "lru", quotas=QuotaTable.equal_shares(trace.tenant_names), quota_label="equal")
    free_hot, equal_hot = free.tenant_hit_ratios()["hot"], equal.tenant_hit_ratios()["hot"]
    assert equal_hot > free_hot + 0.1, (free_hot, equal_hot)
    assert equal.blocks_by_tenant == free.blocks_by_tenant and equal.quotas == "equal"
    # a hard quota on the flood: it holds at most 40 blocks, refuses nothing (its own make room)
    capped = QuotaTable({"flood": {"host": TierQuota(hard=Limit(bytes=40))}})
    hard = rp.replay(trace, tiers, "lru", quotas=capped, block_bytes=1)
    assert hard.refused_blocks == 0 and hard.tenant_hit_ratios()["hot"] > free_hot
    tiny = QuotaTable({"hot": {"host": TierQuota(hard=Limit(bytes=3))}})  # below one prompt: tails refused
    assert rp.replay(trace, tiers, "lru", quotas=tiny, block_bytes=1).refused_blocks > 0


def test_admission_cuts_disk_writes_and_the_cli_reports_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "flood.jsonl"
    write_workload("flood", path, num_requests=2000)
    code, out, err = cli([str(path), "--host", "100", "--disk", "300", "--remote", "600", "--policy", "lru",
                          "--disk-admission", "all,seen_twice,tinylfu", "--remote-admission", "seen_twice",
                          "--quotas", "none", "--quotas", "equal", "--json"], capsys)
    assert code == 0, err
    rows = json.loads(out)["results"]
    assert {(r["admission"], r["quotas"]) for r in rows} == {
        (f"disk={d},remote=seen_twice" if d != "all" else "remote=seen_twice", q)
        for d in ("all", "seen_twice", "tinylfu") for q in ("none", "equal")}
    by = {(r["admission"], r["quotas"]): r for r in rows}
    everything = by[("remote=seen_twice", "none")]["written_blocks_by_tier"]["disk"]
    twice = by[("disk=seen_twice,remote=seen_twice", "none")]["written_blocks_by_tier"]["disk"]
    assert twice * 5 < everything  # one-off flood blocks never reach the disk
    assert all(set(r["hit_ratio_by_tenant"]) == {"flood", "hot"} for r in rows)
    code, out, _ = cli([str(path), "--host", "100", "--disk", "300", "--policy", "lru", "--policy", "belady",
                        "--disk-admission", "all,seen_twice", "--quiet"], capsys)
    assert code == 0 and "disk=seen_twice" in out and "hit ratio by tenant" in out
    assert sum(line.startswith("belady ") for line in out.splitlines()) == 1  # the reference runs once


@pytest.mark.parametrize(("args", "message"), [
    (["--host", "10", "--quotas", "equal"], "quotas need tenants"),
    (["--host", "10", "--disk-admission", "seen_twice"], "--disk-admission needs a --disk tier"),
    (["--host", "10", "--disk", "10", "--disk-admission", "lfu"], "unknown admission policy 'lfu'"),
    (["--disk", "10"], "a cascade"),
    (["--host", "10", "--tenants", "2", "--quotas", "missing.toml"], "--quotas missing.toml"),
])
def test_bad_tenant_and_admission_options(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          args: list[str], message: str) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[1, 2], [3]])
    code, out, err = cli([str(path), *args], capsys)
    assert code == 2 and message in err and out == ""


def test_quota_file_for_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "flood.jsonl"
    write_workload("flood", path, num_requests=1000)
    quotas = tmp_path / "q.toml"
    quotas.write_text('[quotas.hot]\nhost = { soft = "60%" }\n[quotas.flood]\nhost = { soft = "40%", hard = "40%" }\n')
    code, out, err = cli([str(path), "--host", "100", "--policy", "lru", "--quotas", str(quotas), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["results"][0]["quotas"] == "q.toml"
    quotas.write_text('[quotas.nobody]\nhost = { soft = "60%" }\n')
    code, _, err = cli([str(path), "--host", "100", "--quotas", str(quotas)], capsys)
    assert code == 2 and "not the trace's" in err


@pytest.mark.parametrize(("content", "message"), [
    (b'[quotas.t0]\nhost = { soft = "40%\xff" }\n', "can't decode byte 0xff"),
    (b"[quotas.t0]\nhost = " + b"[" * 600 + b"]" * 600 + b"\n", "recursion depth"),
])
def test_a_quota_file_that_is_not_toml_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        content: bytes, message: str) -> None:
    """Found by the quotas fuzz harness (fuzz/regressions/quotas/): tomllib decodes the bytes
    itself and nests by recursion, so these escaped as UnicodeDecodeError and RecursionError."""
    path = write_trace(tmp_path / "t.jsonl", [[1, 2], [3]])
    quotas = tmp_path / "q.toml"
    quotas.write_bytes(content)
    code, out, err = cli([str(path), "--host", "10", "--tenants", "2", "--quotas", str(quotas)], capsys)
    assert code == 2 and f"--quotas {quotas}: " in err and message in err and "Traceback" not in err and out == ""
