"""kill -9 at random instants never leaves a catalog entry whose slot holds other bytes.

A child process writes, overwrites, deletes and touches blocks in a loop; the parent kills it
with SIGKILL at a random moment, reopens the tier, and checks that every cataloged block reads
back exactly the bytes derived from its (key, tenant): the tenant carries the version, so the
checker knows what each key must hold without asking the dead child.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.tiers.disk import DiskTier

PAYLOAD = 12000  # two 4 KiB pages and most of a third: a slot is 12 KiB with padding
NUM_SLOTS = 48  # small, so slots are reused all the time
KILLS = 24
REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import hashlib, random, sys
from kvstore.tiers.disk import DiskTier

path, seed, sync, direct = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
PAYLOAD, NUM_SLOTS = 12000, 48

def payload(key, tenant):
    return memoryview(hashlib.shake_128(key + tenant.encode()).digest(PAYLOAD))

tier = DiskTier(path, NUM_SLOTS * 12288, PAYLOAD, sync=sync, direct_io=direct)
rng = random.Random(seed)
known = {e.key: int(e.tenant[1:]) for e in tier.entries()}
print("ready", flush=True)
while True:
    roll = rng.random()
    if roll < 0.15 and known:
        tier.delete(rng.sample(sorted(known), min(len(known), rng.randint(1, 6))))
        known = {e.key: int(e.tenant[1:]) for e in tier.entries()}
        continue
    if roll < 0.2 and known:
        tier.touch(rng.sample(sorted(known), min(len(known), 3)))
        tier.flush()
        continue
    if roll < 0.45 and known:  # overwrite with a new version
        keys = rng.sample(sorted(known), min(len(known), rng.randint(1, 4)))
        versions = [known[k] + 1 for k in keys]
    else:
        keys = [rng.randbytes(32) for _ in range(rng.randint(1, 10))]
        versions = [0] * len(keys)
    if tier.num_free < len(keys):
        victims = [k for k in sorted(known) if k not in keys]
        tier.delete(rng.sample(victims, min(len(victims), len(keys) + 4)))
        known = {e.key: int(e.tenant[1:]) for e in tier.entries()}
        if tier.num_free < len(keys):
            continue
    tenants = ["v%d" % v for v in versions]
    slots = tier.allocate(len(keys))
    tier.write(keys, slots, [payload(k, t) for k, t in zip(keys, tenants)], tenants, "crash-layout")
    known.update(zip(keys, versions))
"""


def expected_payload(key: bytes, tenant: str) -> bytes:
    return hashlib.shake_128(key + tenant.encode()).digest(PAYLOAD)


def verify_after_crash(path: Path) -> int:
    """Reopen, read every cataloged block, compare exact bytes; return how many there are."""
    with DiskTier(path, NUM_SLOTS * 12288, PAYLOAD) as tier:
        tier.check_integrity()
        entries = list(tier.entries())
        keys = [e.key for e in entries]
        slots = [e.slot for e in entries]
        outs = [bytearray(PAYLOAD) for _ in entries]
        flags = tier.read(keys, slots, [memoryview(out) for out in outs])
        assert flags == [True] * len(entries), f"{flags.count(False)} cataloged blocks failed to verify"
        for entry, out in zip(entries, outs, strict=True):
            assert bytes(out) == expected_payload(entry.key, entry.tenant), (
                f"wrong bytes for {entry.key.hex()}"
            )
        assert tier.errors == 0
        assert tier.num_used == len(entries) and tier.num_reserved == 0
        assert tier.num_slots == NUM_SLOTS
        assert tier.num_free == NUM_SLOTS - len(entries), (
            "slots outside the catalog must be free after reopen"
        )
        tier.check_integrity()
        return len(entries)


@pytest.mark.timeout(120)
def test_sigkill_at_random_instants_never_yields_wrong_bytes(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    rng = random.Random(1234)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    seen: list[int] = []
    for round_ in range(KILLS):
        sync, direct = round_ % 3 != 2, round_ % 2 == 0  # mostly durable; both I/O modes
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), str(round_), str(int(sync)), str(int(direct))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert child.stdout is not None
        line = child.stdout.readline()
        if line.strip() != b"ready":
            child.kill()
            _, err = child.communicate()
            pytest.fail(f"child did not start: {err.decode()[-2000:]}")
        time.sleep(rng.uniform(0.02, 0.4))  # a random moment of its writes to kill it at: the test
        if child.poll() is not None:
            _, err = child.communicate()
            pytest.fail(f"child died before the kill: {err.decode()[-2000:]}")
        os.kill(child.pid, signal.SIGKILL)
        child.communicate()
        seen.append(verify_after_crash(path))
    assert max(seen) > 0, "the children never committed anything: the test proves nothing"
