"""Remote hits through a Redis primary's death: how long a killed primary's blocks are misses,
with reads of its replica (``READONLY``, the default) and without them (``replica_reads=False``,
the tier as it was: every read of the primary's slots a miss until the cluster promotes the
replica).

    python scripts/remote_failover.py [--node-timeout-ms 2000] [--seconds 8] [--rounds 3]

Each round starts a local 3-primary cluster with one replica each (redis-server on PATH),
writes 16 blocks (8 on the victim), waits until the replica has them, kills the victim with
SIGKILL, and reads all 16 every few milliseconds for ``--seconds``. It prints, per mode, the
longest run of reads that missed any block, the time from the kill to the last such read, the
promotion time, and wrong blocks (always 0, or the script exits 1). docs/reliability.md
records a run.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis
from redis.crc import key_slot

from kvstore.tiers.remote import RemoteTier
from kvstore.tools.bench.redis_local import MIB, RedisCluster, need_binaries

PAYLOAD = 64 * 1024


def _payloads(ks: list[bytes]) -> np.ndarray:
    return np.stack([np.random.default_rng(int.from_bytes(k[:8], "little")).integers(0, 256, PAYLOAD, dtype=np.uint8)
                     for k in ks])


def _owner(seed_port: int, name: bytes) -> int:
    slot = key_slot(name)
    for entry in redis.Redis(port=seed_port).execute_command("CLUSTER", "SLOTS"):
        if entry[0] <= slot <= entry[1]:
            return int(entry[2][1])
    raise RuntimeError(f"no owner of slot {slot}")


def one_round(tmp: Path, node_timeout_ms: int, seconds: float, replica_reads: bool) -> dict[str, float]:
    cluster = RedisCluster.start(tmp, maxmemory=24 * MIB, node_timeout_ms=node_timeout_ms)
    try:
        with RemoteTier(cluster.url, PAYLOAD, "failover", timeout_s=0.3, breaker_cooldown_s=0.3,
                        replica_reads=replica_reads) as tier:
            victim = cluster.primaries()[0]
            other = next(n for n in cluster.nodes if n is not victim)
            all_keys = [hashlib.sha256(f"failover/{i}".encode()).digest() for i in range(400)]
            on = [k for k in all_keys if _owner(other.port, tier.names([k])[0]) == victim.port][:8]
            off = [k for k in all_keys if _owner(other.port, tier.names([k])[0]) != victim.port][:8]
            ks = on + off
            data = _payloads(ks)
            tier.put(ks, list(data))
            redis.Redis(port=victim.port).execute_command("WAIT", 1, 5000)
            victim.kill()
            killed = time.monotonic()
            promoted = float("nan")
            reads: list[tuple[float, int]] = []
            wrong = 0
            while (now := time.monotonic()) - killed < seconds:
                tier.forget_hints()
                out = np.zeros_like(data)
                ok = tier.get(ks, list(out))
                reads.append((now - killed, sum(ok)))
                wrong += sum(1 for j in range(len(ks)) if ok[j] and not np.array_equal(out[j], data[j]))
                if promoted != promoted and len(cluster.primaries()) == 3:
                    promoted = time.monotonic() - killed
        short = [at for at, hits in reads if hits < len(ks)]
        return {"last_miss_s": max(short, default=0.0), "short_reads": len(short), "reads": len(reads),
                "promoted_s": promoted, "wrong": wrong}
    finally:
        cluster.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--node-timeout-ms", type=int, default=2000, help="the cluster's node timeout (default 2000)")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds of reads after the kill (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per mode (default 3)")
    args = parser.parse_args(argv)
    if (missing := need_binaries()) is not None:
        parser.error(missing)
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="kvstore-failover-") as tmp:
        for i in range(args.rounds):
            for mode in (False, True):
                r = one_round(Path(tmp) / f"{i}-{mode}", args.node_timeout_ms, args.seconds, mode)
                results[mode].append(r)
                print(f"round {i + 1} replica reads {'on ' if mode else 'off'}: last read short of a hit "
                      f"{r['last_miss_s']:.2f} s after the kill ({r['short_reads']:.0f} of {r['reads']:.0f} reads), "
                      f"replica promoted at {r['promoted_s']:.2f} s, wrong blocks {r['wrong']:.0f}", flush=True)
    for mode in (False, True):
        last = [r["last_miss_s"] for r in results[mode]]
        print(f"replica reads {'on ' if mode else 'off'}: hits whole again {statistics.median(last):.2f} s after the "
              f"kill (median of {len(last)}; {min(last):.2f}-{max(last):.2f})")
    return 1 if any(r["wrong"] for rs in results.values() for r in rs) else 0


if __name__ == "__main__":
    sys.exit(main())
