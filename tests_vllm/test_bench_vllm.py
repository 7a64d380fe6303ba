"""``kvstore bench vllm`` and ``kvstore bench vs-vllm`` end to end at small sizes, as a user runs
them: the random model, one repetition, --no-write. Each table has its rows, each ratio is the
quotient of the figures its row prints (within their rounding), and docs/ is left alone."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

RANDOM_MODEL = "random weights (24 layers, hidden 256, 4 query / 2 KV heads, head dim 64)"


def run_bench(target: str, tmp_path: Path, *flags: str) -> str:
    """Run ``kvstore bench TARGET --random-model --no-write FLAGS``; its stdout. docs/ must not change."""
    docs = ROOT / "docs" / "benchmarks.md"
    before = hashlib.sha256(docs.read_bytes()).hexdigest()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", target, "--random-model", "--no-write",
                           "--dir", str(tmp_path), *flags], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:] + proc.stdout[-3000:]
    assert hashlib.sha256(docs.read_bytes()).hexdigest() == before  # --no-write
    assert not list(tmp_path.glob("kvstore-bench-*")), "the scratch directory was left behind"
    return proc.stdout


def free_port() -> int:
    """A loopback port free now (the bench's servers take it one at a time)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def table(text: str) -> dict[str, list[str]]:
    """The markdown table's rows by their first cell."""
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def number(cell: str, pattern: str) -> tuple[float, float]:
    """The number ``pattern``'s group finds in ``cell``, and half its last printed digit."""
    match = re.search(pattern, cell)
    assert match, f"{pattern!r} not in {cell!r}"
    text = match.group(1)
    decimals = len(text.split(".")[1]) if "." in text else 0
    return float(text), 0.5 * 10.0 ** -decimals


def quotient(top: tuple[float, float], bottom: tuple[float, float]) -> tuple[float, float]:
    """The bounds of top / bottom, each as printed (value, half its last digit)."""
    (a, ha), (b, hb) = top, bottom
    return (a - ha) / (b + hb), (a + ha) / max(b - hb, 1e-9)


def assert_quotient(ratio_cell: str, top: tuple[float, float], bottom: tuple[float, float],
                    pattern: str = r"([0-9.]+)x", scale: float = 1.0, offset: float = 0.0) -> None:
    """The printed ratio is ``(top / bottom) * scale + offset``, within the three roundings."""
    ratio, half = number(ratio_cell, pattern)
    low, high = quotient(top, bottom)
    assert low * scale + offset - half <= ratio <= high * scale + offset + half, (ratio_cell, top, bottom)


MS = r"([0-9.]+) ms"
TOK_S = r"([0-9.]+) tok/s"


def test_bench_vllm_on_the_random_model(tmp_path: Path) -> None:
    out = run_bench("vllm", tmp_path, "--prompt-tokens", "256", "--repeat", "1", "--rounds", "1")
    assert f"Model: {RANDOM_MODEL}, fp32, saved as a Hugging Face directory for vLLM;" in out
    # 256 tokens are two of vLLM's blocks: the first comes from kvstore, the last is computed
    assert "prompt 256 tokens, 128 of them loaded from kvstore" in out
    assert "0 load errors" in out
    rows = table(out)
    assert len(rows) == 6, list(rows)
    for name in ("TTFT, fresh vLLM, prefix in kvstore's host tier (daemon)",
                 "TTFT, prefix on disk after a daemon restart, page cache dropped",
                 "TTFT, vLLM's own warm prefix cache (the ceiling)"):
        ttft, base, base_ttft, ratio, _, _, spread = rows[name]
        assert base == "recompute" and spread == "0% / 0%", name  # one run each
        assert_quotient(ratio, number(base_ttft, MS), number(ttft, MS), r"([0-9.]+)x faster")
    miss, base, down, overhead, target, _, _ = rows["TTFT on a miss (lookup + save of 2 blocks)"]
    assert (base, target) == ("connector, store down", "< +5%")
    assert_quotient(overhead, number(miss, MS), number(down, MS), r"([-+][0-9.]+)%", scale=100, offset=-100)
    critical, _, miss_again, share, _, _, _ = rows["kvstore's time on the critical path of a miss (lookup, "
                                                   "per-layer gathers, queueing the put)"]
    assert miss_again == miss
    assert_quotient(share, number(critical, MS), number(miss, MS), r"([0-9.]+)%", scale=100)
    plain, _, down, ratio, _, _, _ = rows["TTFT, vLLM without any connector (for the record)"]
    assert_quotient(ratio, number(plain, MS), number(down, MS))


def test_bench_vs_vllm_on_the_random_model(tmp_path: Path) -> None:
    out = run_bench("vs-vllm", tmp_path, "--prompt-tokens", "256", "--decode-prompt", "16", "--decode-tokens", "4",
                    "--repeat", "1", "--profile-steps", "1")
    assert f"Model: {RANDOM_MODEL}, fp32 on both sides, saved as a Hugging Face directory for vLLM." in out
    assert "its CPU block of 128 tokens, async scheduling off; the engine: block 16," in out
    # every hit was one: the engine found the whole prompt in the store, vLLM all of it but its last block
    assert ("Every hit of the engine found at least 256 of the prompt's tokens in its host tier (256 over the "
            "daemon); vLLM's connector loaded 128 a hit (the mean).") in out
    assert re.search(r"vLLM's model ran on [0-9]+: its `uni` executor reserves no core", out)
    main, turn = out.split("The engine alone, a next turn from its host tier:")
    rows = table(main)
    prefill = "prefill, 256-token prompt (a miss: TTFT)"
    speed = {prefill: "prefill", **{f"decode, batch {b}": f"decode at batch {b}" for b in (1, 8, 32)}}
    ttfts = ["TTFT, cached 256-token prefix: the engine's host tier / vLLM + kvstore's connector, the prefix in a "
             "daemon's host tier", "same, the engine over the same daemon (its host tier, as vLLM's connector reads it)",
             "TTFT, each engine's own warm prefix cache (the engine's device pool / vLLM's prefix cache)",
             "TTFT, a next turn: 16 new tokens over the cached 256-token prefix, each engine's own warm prefix cache"]
    assert list(rows) == [*speed, *ttfts]
    for cell in rows[prefill][:2]:  # a rate is the prompt over the time
        assert_quotient(f"{number(cell, TOK_S)[0]}x", (256, 0), number(cell, r"\(([0-9]+) ms\)"), scale=1e3)
    behind, even = set(), set()  # even: the table's two decimals say 1.00x, the verdict's own digits decide
    for name, (ours, theirs, ratio, target, met, spread) in rows.items():
        assert spread == "0% / 0%", name  # one run each
        if name in speed:  # kvstore's rate over vLLM's
            assert_quotient(ratio, number(ours, TOK_S), number(theirs, TOK_S))
            assert target == ">= 0.8x" and met == ("yes" if float(ratio.rstrip("x")) >= 0.8 else "NO"), name
            if float(ratio.rstrip("x")) < 1:
                behind.add(speed[name])
            elif float(ratio.rstrip("x")) == 1:
                even.add(speed[name])
        else:  # kvstore ahead when its time is the shorter: vLLM's time over kvstore's
            assert_quotient(ratio, number(theirs, MS), number(ours, MS))
            expected = "> 1x (ahead)" if name == ttfts[0] else "(for reference)"
            assert target == expected, name
    # the text names every row where kvstore is behind, and none where it is not
    verdict = next(line for line in out.splitlines() if line.startswith("Spread: "))
    if behind or not even:
        assert ("kvstore is behind vLLM on" in verdict) == bool(behind), verdict
    for what in speed.values():
        if what in even:  # named only with more digits below 1 ("decode at batch 1 0.997x")
            assert f" {what} " not in verdict or re.search(rf" {what} 0\.99[5-9][0-9]*x", verdict), (what, verdict)
        else:
            assert (f" {what} " in verdict) == (what in behind), (what, verdict)
    # the engine alone: its next turn from host RAM over its bound, each figure as printed
    assert "every hit found at least 256 of its tokens there" in turn
    ((_, ours, bound, ratio, target, met, spread),) = [
        [c.strip() for c in line.split("|")[1:-1]] for line in turn.splitlines() if line.startswith("| TTFT")]
    copy, fresh = number(bound, r"x \(([0-9.]+)"), number(bound, r"\+ ([0-9.]+)")
    total = number(bound, r"^([0-9.]+) ms")
    assert abs(total[0] - 2 * (copy[0] + fresh[0])) <= total[1] + 2 * (copy[1] + fresh[1])
    assert_quotient(f"{ratio}x", number(ours, MS), total)
    assert target == "<= 1" and met == ("yes" if float(ratio) <= 1 else "NO") and spread == "0% / 0% / 0%"
    profiles = [line for line in out.splitlines() if line.startswith(("- prefill, ", "- next turn ", "- decode step, "))]
    assert [line.split(":")[0] for line in profiles] == [
        f"- {what}, {side}" for what in ("prefill", "next turn (16 tokens over 256 cached)", "decode step, batch 1",
                                         "decode step, batch 8", "decode step, batch 32")
        for side in ("kvstore engine", "vLLM")]
    for line in profiles:  # each profile found the products of the model's layers, on whatever thread ran them
        assert re.search(r"`(aten::mm|aten::addmm|mkldnn::_linear_pointwise|_C::onednn_mm)` [0-9.]+", line), line


def test_bench_serving_judges_the_engine_against_the_faster_vllm(tmp_path: Path) -> None:
    """The engine and vLLM in both of its configurations (as shipped, and with no core reserved
    for its frontend: its model on both cores) start, serve every request of each workload
    through vLLM's client, and stop; each row's baseline is vLLM's better figure of the two, and
    its ratio the quotient of the engine's figure and that one (TTFT and TPOT: lower is better)."""
    port = free_port()
    out = run_bench("serving", tmp_path, "--enforce-eager", "--prefix-tokens", "64", "--suffix-tokens", "8",
                    "--output-tokens", "4", "--rate", "8", "--rate-requests", "4", "--concurrency", "2",
                    "--rounds", "1", "--port", str(port))
    assert RANDOM_MODEL in out
    assert ("in 2 configurations of its cores (as shipped (VLLM_CPU_NUM_OF_RESERVED_CPU unset: on 2 cores its model "
            "runs on 1); 0 reserved (VLLM_CPU_NUM_OF_RESERVED_CPU=0: its model on every core))") in out
    header = next(line for line in out.splitlines() if line.startswith("| workload"))
    assert [c.strip() for c in header.split("|")[3:6]] == ["kvstore engine", "vLLM as shipped", "vLLM 0 reserved"]
    rows = {(cells[0].strip(), cells[1].strip()): [c.strip() for c in cells[2:]]
            for cells in (line.split("|")[1:-1] for line in out.splitlines()
                          if line.startswith("| ") and "---" not in line and not line.startswith("| workload"))}
    workloads = ("4 requests at 8/s, 2 prefixes", "concurrency 2, 4 requests, 4 prefixes")
    measurements = ("mean TTFT", "median TTFT", "mean TPOT", "output throughput")
    assert set(rows) == {(w, m) for w in workloads for m in measurements}
    for (workload, measurement), (ours, shipped, both_cores, baseline, ratio, target, met, spread) in rows.items():
        unit = r"([0-9.]+) (?:ms|tok/s)"
        a, s, z = number(ours, unit), number(shipped, unit), number(both_cores, unit)
        assert a[0] > 0 and s[0] > 0 and z[0] > 0, (workload, measurement)
        higher_is_better = measurement == "output throughput"
        better = (s, "as shipped") if (s[0] > z[0]) == higher_is_better else (z, "0 reserved")
        if s[0] != z[0]:
            assert baseline == better[1], (workload, measurement, shipped, both_cores, baseline)
        b = better[0]
        if higher_is_better:
            assert_quotient(ratio, a, b)
        else:
            assert_quotient(ratio, b, a)  # a speed: vLLM's time over kvstore's
        judged = (measurement == "mean TTFT" and workload.startswith("4 requests")) or (
            measurement in ("mean TPOT", "output throughput") and workload.startswith("concurrency"))
        assert (met in ("yes", "NO")) == judged and (target != "(for reference)") == judged
        assert target in ("(for reference)", ">= 0.91x (TTFT <= 1.1x vLLM's)", ">= 0.9x"), target
        assert len(spread.split(" / ")) == 3
    assert ("Every target met." in out) != ("Missed:" in out)


def test_bench_serving_overflow_brings_users_back_to_all_three_servers(tmp_path: Path) -> None:
    """Users whose histories overflow every device pool come back: the engine, vLLM, and vLLM
    with kvstore's connector on a daemon each serve all of them, and both ratios are quotients of
    the TTFTs printed."""
    port = free_port()
    out = run_bench("serving", tmp_path, "--overflow", "--enforce-eager", "--users", "6", "--pool-users", "2",
                    "--history-tokens", "400", "--output-tokens", "4", "--host-gib", "1", "--port", str(port),
                    "--vllm-reserved-cpus", "0")
    rows = table(out)
    assert set(rows) == {"kvstore engine", "vLLM, no connector", "vLLM + kvstore's connector"}
    ours = number(rows["kvstore engine"][0], r"([0-9.]+) ms")
    for name, want in (("vLLM, no connector", ">= 2x"), ("vLLM + kvstore's connector", ">= 1x")):
        theirs, ratio, target, met = rows[name][0], rows[name][3], rows[name][4], rows[name][5]
        assert target == want and met in ("yes", "NO")
        assert_quotient(ratio, number(theirs, r"([0-9.]+) ms"), ours)
    assert "6 users, each with a 400-token history" in out
    assert "(0 reserved (VLLM_CPU_NUM_OF_RESERVED_CPU=0: its model on every core))" in out  # as asked


def test_bench_serving_refuses_a_history_too_long_for_the_client(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "serving", "--overflow", "--random-model",
                           "--history-tokens", "1000", "--no-write", "--dir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--history-tokens 1000 leaves no room" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_serving_refuses_a_negative_reserved_core_count(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "serving", "--random-model",
                           "--vllm-reserved-cpus", "shipped,-1", "--dir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "kvstore bench serving: --vllm-reserved-cpus must be 0 or more"


def test_bench_serving_refuses_a_configuration_it_cannot_read(tmp_path: Path) -> None:
    for flag, why in (("as-shipped", "expected core counts or 'shipped'"), ("0,shipped,0", "named twice")):
        proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "serving", "--random-model",
                               "--vllm-reserved-cpus", flag, "--dir", str(tmp_path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and why in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_bench_serving_overflow_judges_every_vllm_configuration_it_ran() -> None:
    """With vLLM run in both configurations of its cores, the overflow table has a row per server
    and configuration, each named and judged against the engine (the figures: a real run's,
    19:22-19:39 UTC on 12-07, docs/benchmarks.md)."""
    from kvstore.cli import build_parser
    from kvstore.tools.bench.models import BenchModel
    from kvstore.tools.bench.serving_overflow import render_overflow
    from kvstore.tools.bench.serving_servers import Arm

    args = build_parser().parse_args(["bench", "serving", "--overflow", "--random-model"])
    assert args.vllm_reserved_cpus == [None, 0]  # the default: as shipped and on every core
    args.bench_model = BenchModel.from_args(args)
    figures = {Arm("kvstore"): 137.4, Arm("vllm", None): 2497.4, Arm("vllm", 0): 1303.3,
               Arm("vllm+kvstore", None): 194.3, Arm("vllm+kvstore", 0): 189.1}
    out = render_overflow({arm: {"mean_ttft_ms": t, "median_ttft_ms": t, "mean_tpot_ms": 50.0}
                           for arm, t in figures.items()}, args)
    rows = table(out)
    assert list(rows) == ["kvstore engine", "vLLM, no connector (as shipped)", "vLLM, no connector (0 reserved)",
                          "vLLM + kvstore's connector (as shipped)", "vLLM + kvstore's connector (0 reserved)"]
    for name, cells in list(rows.items())[1:]:
        assert cells[4] == (">= 2x" if "no connector" in name else ">= 1x") and cells[5] == "yes", name
        assert_quotient(cells[3], number(cells[0], MS), number(rows["kvstore engine"][0], MS))
    assert "(as shipped (VLLM_CPU_NUM_OF_RESERVED_CPU unset" in out and "0 reserved (VLLM_CPU_NUM_OF_RESERVED_CPU=0" in out
