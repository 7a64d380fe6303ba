"""Fixtures of the remote tier's tests: a real Redis Cluster and a real single redis-server.

Each starts once per module (a cluster start costs seconds). Without redis-server/redis-cli
the tests are skipped on a developer machine and fail under CI=true (.ci/run installs them).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvstore.tools.bench.redis_local import MIB, RedisCluster, RedisServer, need_binaries


def require_redis() -> None:
    missing = need_binaries()
    if missing is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and {missing}: the remote tier's tests need a real Redis")
    pytest.skip(missing)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """3 primaries + 3 replicas, 24 MiB maxmemory each, allkeys-lru, no persistence."""
    require_redis()
    found = RedisCluster.start(tmp_path_factory.mktemp("cluster"), maxmemory=24 * MIB)
    yield found
    found.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server (the redis:// case)."""
    require_redis()
    found = RedisServer.start(tmp_path_factory.mktemp("server"))
    yield found
    found.close()
