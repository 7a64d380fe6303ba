"""Two engines ("two nodes") share a prefix through the remote tier: the second one fetches
it instead of recomputing, and generates exactly the tokens the first did."""

from __future__ import annotations

import pytest

from kvstore import ConfigError
from kvstore.engine.llm import LLMEngine
from kvstore.engine.sampling import SamplingParams
from kvstore.tools.bench.redis_local import RedisCluster

TINY = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
            vocab_size=256, max_position_embeddings=512)


def engine(cluster: RedisCluster, **kwargs: object) -> LLMEngine:
    opts: dict[str, object] = dict(random_model=TINY, kv_cache_bytes=1 << 22, host_bytes=1 << 24,
                                   remote_url=cluster.url, block_size=16, fetch_policy="always")
    opts.update(kwargs)
    return LLMEngine(None, **opts)  # type: ignore[arg-type]


def test_a_second_engine_fetches_the_prefix_from_remote(cluster: RedisCluster) -> None:
    prompt = list(range(3, 200))  # 12 full blocks + 5 tokens
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = engine(cluster)
    try:
        expected = first.generate([prompt], params)[0]
        assert first.evict_device_cache() > 0  # device -> host; the store sends them remote
        assert first.store.flush(timeout=10)
    finally:
        first.close()
    second = engine(cluster)
    try:
        out = second.generate([prompt], params)[0]
        assert out.metrics.cached_tokens["remote"] == 12 * 16
        assert out.token_ids == expected.token_ids
        stats = second.stats()
        assert stats["remote"]["hits"] >= 12 and stats["engine"]["fetched_blocks"] == 12
        assert stats["engine"]["remote_bandwidth"] > 0
    finally:
        second.close()


def test_remote_url_needs_the_embedded_store(cluster: RedisCluster) -> None:
    with pytest.raises(ConfigError, match="remote_url"):
        engine(cluster, host_bytes=0)
