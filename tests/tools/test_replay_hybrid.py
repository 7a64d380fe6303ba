"""kvstore replay --layout: a trace as a hybrid model's KV groups (kvstore/tools/replay/hybrid.py).

The hand-made traces below use ``groups:1f+1s512`` (one full group, one sliding group whose
window is 1 trace block; a group block is half an all-layers block) under LRU, so that every
eviction is known. Names: f<i> / s<i> are the full / sliding group's blocks of trace block i.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.engine.groups import DeviceGroups
from kvstore.layout import FULL, SLIDING, KVGroup, KVLayout
from kvstore.tools import replay as rp
from kvstore.tools.replay.hybrid import (
    GroupLayout,
    GroupReplayResult,
    hit_boundary,
    parse_layout,
    replay_groups,
)

PAIR = "groups:1f+1s512"
A = [1, 2, 3, 4]  # cools s1, s2, s3 (below the window at boundary 4: s4)
FILLER = [9, 10]  # four new group blocks: two evictions in a tier of 5 blocks (10 group blocks)


def write_trace(path: Path, requests: list[list[int]], lengths: list[int] | None = None) -> Path:
    path.write_text("".join(
        json.dumps({"hash_ids": ids, "input_length": lengths[i] if lengths else 512 * len(ids)}) + "\n"
        for i, ids in enumerate(requests)))
    return path


def hits_per_request(tmp_path: Path, requests: list[list[int]], caps: tuple[int, ...] = (5,),
                     layout: str = PAIR, lengths: list[int] | None = None,
                     **kwargs: str) -> tuple[list[int], GroupReplayResult]:
    """Each request's hit (replays of every leading part of the trace, differenced), and the
    whole trace's result."""
    tiers = [rp.TierSpec(name, c) for name, c in zip(("host", "disk"), caps, strict=False)]
    spec = parse_layout(layout)
    assert spec is not None
    out, before = [], 0
    for k in range(1, len(requests) + 1):
        trace = rp.load_trace(write_trace(tmp_path / f"t{k}.jsonl", requests[:k], lengths and lengths[:k]))
        result = replay_groups(trace, tiers, "lru", spec, **kwargs)
        out.append(result.hits - before)
        before = result.hits
    return out, result


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


# ----------------------------------------------------------------------------- the reconciled hit


def test_a_missing_window_block_shrinks_the_hit(tmp_path: Path) -> None:
    # FILLER evicts the cooled s3 and s2 (tails first); f1..f3 and s1 stay. [1, 2, 3] needs s3
    # at boundary 3, s2 at 2, s1 at 1: the hit is 1. As all-full blocks (one group) it is 3.
    assert hits_per_request(tmp_path, [A, FILLER, [1, 2, 3]])[0] == [0, 0, 1]
    assert hits_per_request(tmp_path, [A, FILLER, [1, 2, 3]], layout="groups:1f")[0] == [0, 0, 3]


def test_blocks_below_the_window_are_not_needed(tmp_path: Path) -> None:
    # s2 and s3 are gone, but a hit at boundary 4 needs only s4 of the sliding group
    hits, result = hits_per_request(tmp_path, [A, FILLER, [1, 2, 3, 4, 5]])
    assert hits == [0, 0, 4] and result.hits_by_tier == {"host": 4}


def test_wider_windows_need_every_block_of_the_window(tmp_path: Path) -> None:
    # W = 1024 tokens: 2 blocks of 512. A cools s1, s2 only, and FILLER evicts them. A hit at
    # 4 needs s3 and s4 (kept); at 3, s2 and s3 (s2 is gone); at 1, s1 (gone): [1, 2, 3] gets 0.
    layout = "groups:1f+1s1024"
    assert hits_per_request(tmp_path, [A, FILLER, [1, 2, 3, 4, 5]], layout=layout)[0] == [0, 0, 4]
    assert hits_per_request(tmp_path, [A, FILLER, [1, 2, 3]], layout=layout)[0] == [0, 0, 0]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_hit_is_the_engines_reconciled_boundary(data: st.DataObject) -> None:
    block_size = data.draw(st.sampled_from([1, 4, 16]))
    windows = data.draw(st.lists(st.sampled_from([None, 2, 5, 16, 33]), min_size=1, max_size=4))
    groups = tuple(KVGroup(FULL, (g,)) if w is None else KVGroup(SLIDING, (g,), w) for g, w in enumerate(windows))
    engine = DeviceGroups(KVLayout(1, 1, 8, block_size=block_size, groups=groups), num_layers=len(groups))
    num_blocks = data.draw(st.integers(0, 12))
    held = data.draw(st.sets(st.tuples(st.integers(0, len(groups) - 1), st.integers(0, max(0, num_blocks - 1)))))

    def present(g: int, i: int) -> bool:
        return (g, i) in held

    full = [g for g, w in enumerate(engine.windows) if w is None]
    sliding = [(g, w) for g, w in enumerate(engine.windows) if w is not None]
    assert hit_boundary(num_blocks, full, sliding, present) == engine.reconcile(num_blocks, present)


# ----------------------------------------------------------------------------- cooling


def test_cooled_blocks_leave_first_tails_first(tmp_path: Path) -> None:
    # After A, FILLER's two evictions take s3 then s2 (cooled, tail first), not the LRU f4:
    # [1, 2, 3, 4] hits whole, and s1 is still there for a hit at boundary 1.
    assert hits_per_request(tmp_path, [A, FILLER, A])[0] == [0, 0, 4]
    assert hits_per_request(tmp_path, [A, FILLER, [1, 7]])[0] == [0, 0, 1]


def test_the_window_of_the_hit_is_not_cooled(tmp_path: Path) -> None:
    # [1, 2, 5, 6, 7] hits at boundary 2 (f1, f2, s2) and ends at 5: it cools s1, s5, s6 but
    # not s2, the window of a boundary it used. [20, 21, 22] then evicts six blocks: the four
    # cooled ones (s6, s5, s1, then A's s3) and the LRU f4, f3. s2 stays: [1, 2, 8] hits 2.
    hits, result = hits_per_request(tmp_path, [A, [1, 2, 5, 6, 7], [20, 21, 22], [1, 2, 8]], caps=(7,))
    assert hits == [0, 2, 0, 2]
    # newly cooled: A s1-s3; then s5, s6 (s1 was cold); the filler's s20, s21; none (s1 is gone)
    assert result.cooled_blocks == 3 + 2 + 2 + 0


def test_a_request_ends_at_its_full_prompt_blocks(tmp_path: Path) -> None:
    # A's last id is a partial block (input_length 3 x 512 + 100): it ends at boundary 3, so
    # s3 stays warm for the next turn, which shares the 3 full blocks. Ending at its last id
    # instead cools s3 too, and the next turn's hit falls to 1 (s1 is all that survives).
    requests, lengths = [A, FILLER, [1, 2, 3, 7]], [3 * 512 + 100, 1024, 4 * 512]
    assert hits_per_request(tmp_path, requests, lengths=lengths)[0] == [0, 0, 3]
    assert hits_per_request(tmp_path, requests, lengths=lengths, cool_at="last-block")[0] == [0, 0, 1]


# ----------------------------------------------------------------------------- cold_blocks


def test_cold_blocks_demote_writes_cooled_blocks_down_and_drop_does_not(tmp_path: Path) -> None:
    requests = [A, FILLER, [1, 2, 3]]
    hits, demote = hits_per_request(tmp_path, requests, caps=(5, 4), cold_blocks="demote")
    # s3 and s2 go to disk: the hit at 3 is whole, its s3 read from disk
    assert hits == [0, 0, 3] and demote.hits_by_tier == {"host": 2, "disk": 1}
    assert demote.read_blocks == {"host": 0, "disk": 1} and demote.written_blocks == {"host": 0, "disk": 3}
    assert (demote.cold_dropped_blocks, demote.dropped_blocks) == (0, 0)
    hits, drop = hits_per_request(tmp_path, requests, caps=(5, 4), cold_blocks="drop")
    # s3 and s2 leave the store (and FILLER's cooled s9 when [1, 2, 3] makes room): hit 1
    assert hits == [0, 0, 1] and drop.hits_by_tier == {"host": 1, "disk": 0}
    assert drop.written_blocks == {"host": 0, "disk": 1}  # the warm f4, demoted as any block
    assert (drop.cold_dropped_blocks, drop.dropped_blocks) == (3, 3)


def test_a_later_use_warms_a_cooled_block(tmp_path: Path) -> None:
    # A cools s3; [1, 2, 3] hits at 3 and so uses s3: warm again, it is demoted under "drop"
    # when the filler pushes it out of host, and the last request hits 3 (s3 read from disk).
    # Where the second request is [1, 2, 7] instead, s3 stays cold, is dropped, and the last
    # request's hit stops at 2 (s2, the window [1, 2, 7] used, was kept warm).
    filler, last = [30, 31, 32, 33], [1, 2, 3, 8]
    hits, _ = hits_per_request(tmp_path, [A, [1, 2, 3], filler, last], caps=(5, 20), cold_blocks="drop")
    assert hits == [0, 3, 0, 3]
    hits, _ = hits_per_request(tmp_path, [A, [1, 2, 7], filler, last], caps=(5, 20), cold_blocks="drop")
    assert hits == [0, 2, 0, 2]


# ----------------------------------------------------------------------------- same bytes


def test_capacities_are_all_layers_blocks_of_group_blocks(tmp_path: Path) -> None:
    layout = parse_layout("gemma3-270m")
    assert layout is not None and layout.group_blocks_per_block == 6
    assert [g.kind for g in layout.groups] == [SLIDING] * 5 + [FULL]
    assert layout.groups[0].layers == (0, 6, 12) and layout.groups[-1].layers == (5, 11, 17)
    assert layout.windows(512) == [1] * 5 + [None] and layout.windows(16) == [32] * 5 + [None]
    # a tier of 3 blocks holds 18 group blocks: the 3-block prompt's 18 fit, nothing is lost
    trace = rp.load_trace(write_trace(tmp_path / "t.jsonl", [[1, 2, 3], [1, 2, 3]]))
    result = replay_groups(trace, [rp.TierSpec("host", 3)], "lru", layout)
    assert result.tier_group_blocks() == {"host": 18} and (result.hits, result.dropped_blocks) == (3, 0)
    # a prompt longer than the tier is cut to its capacity in all-layers blocks, as sim cuts it
    trace = rp.load_trace(write_trace(tmp_path / "t.jsonl", [[1, 2, 3, 4], [1, 2, 3, 4]]))
    result = replay_groups(trace, [rp.TierSpec("host", 3)], "lru", layout)
    assert (result.hits, result.prompt_blocks) == (3, 8)


@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_one_full_group_is_todays_replay(tmp_path: Path, policy: str) -> None:
    rng = random.Random(7)
    requests = []
    for _ in range(300):  # conversations that grow, over a few shared system prompts
        base = [rng.randrange(4)] + [rng.randrange(40) for _ in range(rng.randrange(6))]
        requests.append(base + [rng.randrange(1000) for _ in range(rng.randrange(1, 8))])
    trace = rp.load_trace(write_trace(tmp_path / "t.jsonl", requests))
    full = GroupLayout("one group", (KVGroup(FULL, (0,)),), 1)
    for caps in ((40,), (20, 60)):
        tiers = [rp.TierSpec(name, c) for name, c in zip(("host", "disk"), caps, strict=False)]
        ours, today = replay_groups(trace, tiers, policy, full), rp.replay(trace, tiers, policy)
        assert (ours.hits, ours.hits_by_tier, ours.read_blocks, ours.written_blocks, ours.dropped_blocks) == \
            (today.hits, today.hits_by_tier, today.read_blocks, today.written_blocks, today.dropped_blocks)
        assert ours.cooled_blocks == 0


# ----------------------------------------------------------------------------- the command line


def test_cli_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_trace(tmp_path / "t.jsonl", [A, FILLER, [1, 2, 3], A])
    code, out, err = cli([str(path), "--layout", "gemma3-270m", "--host", "1", "--disk", "4",
                          "--cold-blocks", "demote,drop", "--policy", "lru", "--quiet"], capsys)
    assert code == 0 and err == "", err
    assert "6 KV groups (1 full, 5 sliding, W = 512 tokens = 1 block of 512)" in out
    assert "a tier of C holds C x 6 group blocks, the bytes of C blocks of all-full" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("lru ")]
    assert [r[2] for r in rows] == ["demote", "drop"] and all(r[1] == "1/4" for r in rows)
    code, out, _ = cli([str(path), "--layout", "groups:1f+5s512", "--capacity", "2,3", "--json", "--quiet"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["layout"]["group_blocks_per_block"] == 6
    assert doc["layout"]["groups"][1] == {"kind": "sliding", "window_tokens": 512, "window_blocks": 1}
    assert [(r["policy"], r["tier_capacity_blocks"]["device"], r["tier_capacity_group_blocks"]["device"])
            for r in doc["results"]] == [("reuse", 2, 12), ("lru", 2, 12), ("reuse", 3, 18), ("lru", 3, 18)]
    row = doc["results"][0]
    assert row["x_all_full"] == pytest.approx(row["hit_ratio"] / row["all_full_hit_ratio"])


def test_layout_full_is_todays_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_trace(tmp_path / "t.jsonl", [A, FILLER, [1, 2, 3], A])
    outs = []
    for extra in ([], ["--layout", "full"]):
        code, out, _ = cli([str(path), "--capacity", "3", "--json", "--quiet", *extra], capsys)
        doc = json.loads(out)
        for row in doc["results"]:
            row.pop("replay_seconds")
        outs.append(doc)
        assert code == 0
    assert outs[0] == outs[1]


@pytest.mark.parametrize(("args", "message"), [
    (["--layout", "gemma4"], "argument --layout: must be full, gemma3-270m or groups:TERM"),
    (["--layout", "groups:1f+5x512"], "e.g. groups:1f+5s512; got 'groups:1f+5x512'"),
    (["--layout", "groups:0f"], "got 'groups:0f'"),
    (["--layout", "groups:"], "got 'groups:'"),
    (["--layout", "groups:1s0"], "a sliding KVGroup needs a window of at least 1 token, got 0"),
    (["--layout", "gemma3-270m", "--cold-blocks", "keep"], "unknown cold_blocks setting 'keep'; known: ['demote', 'drop']"),
    (["--layout", "gemma3-270m", "--cool-at", "end"], "invalid choice: 'end'"),
    (["--cold-blocks", "drop"], "--cold-blocks and --cool-at need a hybrid --layout"),
    (["--layout", "full", "--cool-at", "last-block"], "--cold-blocks and --cool-at need a hybrid --layout"),
    (["--layout", "gemma3-270m", "--policy", "belady"], "runs the online policies ['reuse', 'lru'], not ['belady']"),
    (["--layout", "gemma3-270m", "--quotas", "equal"], "without tenants: leave out --quotas"),
    (["--layout", "gemma3-270m", "--tenants", "2"], "leave out --tenants"),
    (["--layout", "gemma3-270m", "--host", "4", "--disk", "8", "--disk-admission", "seen_twice"],
     "leave out --disk-admission"),
])
def test_bad_layout_options_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             args: list[str], message: str) -> None:
    path = write_trace(tmp_path / "t.jsonl", [A])
    args = args if "--host" in args else [*args, "--capacity", "4"]
    code, out, err = cli([str(path), *args, "--quiet"], capsys)
    assert code == 2 and message in err and "Traceback" not in err and out == "", err
