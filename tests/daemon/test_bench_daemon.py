"""``kvstore bench daemon --pin``: the servers on a CPU of their own, the clients on the rest.

Pinning is checked on real processes (a child started inside ``on_cpus`` and this process's
threads), and the command itself is run once, briefly, against a real daemon and redis-server.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch

from kvstore.tools.bench.daemon import on_cpus, split_cpus

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="pinning needs two CPUs")  # the CI machine has two


def _affinity_of_child() -> set[int]:
    child = subprocess.run([sys.executable, "-c", "import json, os; print(json.dumps(sorted(os.sched_getaffinity(0))))"],
                           capture_output=True, text=True, check=True, timeout=60)
    return set(json.loads(child.stdout))


@needs_two
def test_split_cpus_gives_the_servers_the_last_cpu_and_the_clients_the_rest() -> None:
    servers, clients = split_cpus()
    assert servers == {CPUS[-1]} and clients == set(CPUS[:-1])


@needs_two
def test_on_cpus_moves_every_thread_and_the_processes_it_starts_then_restores_them() -> None:
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)  # a thread started before the pinning
    worker.start()
    threads = torch.get_num_threads()
    try:
        with on_cpus({CPUS[0]}):
            assert os.sched_getaffinity(worker.native_id) == {CPUS[0]}
            assert os.sched_getaffinity(0) == {CPUS[0]}
            assert torch.get_num_threads() == 1
            assert _affinity_of_child() == {CPUS[0]}
        assert os.sched_getaffinity(0) == set(CPUS)
        assert os.sched_getaffinity(worker.native_id) == set(CPUS)
        assert torch.get_num_threads() == threads
        assert _affinity_of_child() == set(CPUS)
    finally:
        stop.set()
        worker.join()


def test_on_cpus_none_changes_nothing() -> None:
    with on_cpus(None):
        assert os.sched_getaffinity(0) == set(CPUS)


def test_pin_on_one_cpu_is_refused_with_a_clear_error() -> None:
    one_cpu = (f"import os, sys; os.sched_setaffinity(0, {{{CPUS[0]}}}); from kvstore.cli import main; "
               "sys.exit(main(['bench', 'daemon', '--pin', '--no-write']))")
    proc = subprocess.run([sys.executable, "-c", one_cpu], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--pin needs two CPUs or more; this process may use only CPU {CPUS[0]}" in proc.stdout


@needs_two
def test_bench_daemon_pin_runs_against_real_servers_and_says_where_they_ran() -> None:
    if shutil.which("redis-server") is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI=true and no redis-server: the daemon benchmark needs it")
        pytest.skip("needs redis-server")
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "daemon", "--pin", "--repeat", "1",
                           "--no-write"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "## Daemon, servers on a CPU of their own (`kvstore bench daemon --pin`)" in out
    clients = ",".join(str(c) for c in CPUS[:-1])
    assert f"The daemon and redis-server run on CPU {CPUS[-1]}, the clients and the memcpy baselines on CPU {clients}" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and " ms |" in line]
    assert [r.split(" | ")[0] for r in rows] == [
        "| put over Unix socket, 64 x 192 KiB", "| get over Unix socket, 64 x 192 KiB",
        "| put over shared memory, 64 x 192 KiB (a run of 8, to flush())", "| get over shared memory, 64 x 192 KiB",
        "| lookup of a 2,000-block chain, round trip"]
    assert "wrote docs/benchmarks.md" not in out
