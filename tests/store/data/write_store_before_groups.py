"""How store_before_groups.tar.gz was made: run with kvstore at commit add261d (the release
before KV groups) on the path, then ``tar -czf store_before_groups.tar.gz disk`` in OUT.

    PYTHONPATH=<checkout at add261d> python write_store_before_groups.py OUT

It prints the keys it stored; tests/store/test_store_upgrade.py holds them.
"""

import hashlib
import sys
from pathlib import Path

import torch

from kvstore import KVLayout, StoreConfig, TieredStore

out = Path(sys.argv[1])
layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
store = TieredStore(StoreConfig(layout=layout, model_id="upgrade-model", host_bytes=8 * 4096,
                                disk_path=out / "disk", disk_bytes=16 * 4096))


def payload(key: bytes) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)
    return torch.randn(layout.block_shape, generator=torch.Generator().manual_seed(seed))


tokens = list(range(6 * 4))
for tenant in ("", "acme"):
    keys = store.block_keys(tokens, tenant=tenant)
    store.put(keys, torch.stack([payload(k) for k in keys]), tenant=tenant)
    print(tenant or "-", [k.hex() for k in keys])
store.close()
