"""Remote admission through a real Redis Cluster: only the blocks the policy admits are sent."""

from __future__ import annotations

import time

import pytest

from kvstore.tiers.remote.hints import HINT_TTL_S
from kvstore.tools.bench.redis_local import RedisCluster

from factories import blocks_for, chain, make_store


@pytest.mark.parametrize("admission", ["seen_twice", "tinylfu"])
def test_only_blocks_used_twice_leave_for_the_remote(cluster: RedisCluster, admission: str) -> None:
    common = dict(remote_url=cluster.url, remote_timeout_s=3.0, remote_prefix=f"adm-{admission}")
    with make_store(None, host_blocks=4, remote_writes="demote", remote_admission=admission, **common) as node_a, \
            make_store(None, host_blocks=8, **common) as node_b:
        reused = chain(node_a, 2, salt=1)
        node_a.put(reused, blocks_for(reused))
        node_a.get(reused)  # its second use
        once = chain(node_a, 2, salt=2)
        node_a.put(once, blocks_for(once))
        pushes = chain(node_a, 4, salt=3)
        node_a.put(pushes, blocks_for(pushes))  # both chains leave host RAM, the node's last tier
        assert node_a.flush(10)
        time.sleep(HINT_TTL_S)  # the hint TTL under test: another node's write is seen at most this late
        assert node_b.lookup(reused).tiers == ("remote", "remote")
        assert node_b.lookup(once).num_blocks == 0
    with make_store(None, host_blocks=4, remote_writes="put", remote_admission="seen_twice", **common) as node_c, \
            make_store(None, host_blocks=8, **common) as node_d:
        fresh = chain(node_c, 3, salt=4)
        node_c.put(fresh, blocks_for(fresh))  # a first put: not sent under seen_twice
        assert node_c.flush(10)
        time.sleep(HINT_TTL_S)  # an absence: had it been sent, node D would see it by now
        assert node_d.lookup(fresh).num_blocks == 0
