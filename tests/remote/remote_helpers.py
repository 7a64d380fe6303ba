"""Shared helpers of the remote tests: keys, deterministic payloads, a tier factory."""

from __future__ import annotations

import hashlib

import numpy as np
import redis
from redis.crc import key_slot

from kvstore.redis_local import RedisCluster
from tiers.remote import RemoteTier

PAYLOAD = 64 * 1024
LAYOUT_ID = "L2-H2-D64-B16-float16-tp0of1"


def keys(tag: str, n: int) -> list[bytes]:
    """``n`` distinct 32-byte keys, different for every ``tag``."""
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def payloads(ks: list[bytes], size: int = PAYLOAD) -> np.ndarray:
    """Contents derived from each key, so any reader can tell right bytes from wrong."""
    rows = [np.random.default_rng(int.from_bytes(k[:8], "little")).integers(0, 256, size, dtype=np.uint8)
            for k in ks]
    return np.stack(rows)


def tier(url: str, **kwargs: object) -> RemoteTier:
    kwargs.setdefault("timeout_s", 0.5)
    return RemoteTier(url, PAYLOAD, LAYOUT_ID, **kwargs)  # type: ignore[arg-type]


def owner_port(cluster: RedisCluster, name: bytes) -> int:
    """The port of the live primary that holds ``name`` (asked of the cluster itself)."""
    slot = key_slot(name)
    seed = next(n for n in cluster.nodes if n.alive)
    for entry in redis.Redis(port=seed.port).execute_command("CLUSTER", "SLOTS"):
        if entry[0] <= slot <= entry[1]:
            return int(entry[2][1])
    raise AssertionError(f"no owner of slot {slot}")
