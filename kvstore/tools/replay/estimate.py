"""What a replay's hits would be worth: bytes each tier moves, prefill time saved.

Defaults describe a 512-token block of Llama-3-8B in fp16: 32 layers x 8 KV heads x 128 dims x
2 (K, V) x 2 bytes = 128 KiB per token, 64 MiB per block. Tier bandwidths default to round
figures for PCIe host copies and one NVMe drive, unless ``kvstore bench tiers`` measured this
machine's and wrote ``docs/bench_tiers.json`` ({"host_read_gbps": x, "disk_read_gbps": y}).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvstore.tools.bench.harness import DOCS
from kvstore.tools.replay.sim import ReplayResult

BLOCK_TOKENS = 512
BLOCK_BYTES = 32 * 8 * 128 * 2 * 2 * BLOCK_TOKENS  # Llama-3-8B fp16: 64 MiB per block
HOST_GBPS = 20.0  # pinned host -> GPU over PCIe 4.0 x16, a typical achieved rate
DISK_GBPS = 3.0  # one PCIe 4.0 NVMe drive, sequential reads
PREFILL_TOKENS_PER_S = 10_000.0  # an 8B model's prefill on one current datacenter GPU
BENCH_TIERS_JSON = DOCS / "bench_tiers.json"


def measured_gbps(path: Path = BENCH_TIERS_JSON) -> dict[str, float]:
    """Bandwidths ``kvstore bench tiers`` measured here, by tier name; {} when absent or bad."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out: dict[str, float] = {}
    for tier, field in (("host", "host_read_gbps"), ("disk", "disk_read_gbps")):
        value = data.get(field) if isinstance(data, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
            out[tier] = float(value)
    return out


@dataclass(frozen=True)
class CostModel:
    """Per-block costs: recomputing a block vs fetching it from a tier (the device: free)."""

    block_tokens: int = BLOCK_TOKENS
    block_bytes: int = BLOCK_BYTES
    prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S
    host_gbps: float = HOST_GBPS
    disk_gbps: float = DISK_GBPS

    @property
    def recompute_seconds(self) -> float:
        return self.block_tokens / self.prefill_tokens_per_s

    def fetch_seconds(self, tier: str) -> float:
        gbps = {"host": self.host_gbps, "disk": self.disk_gbps}.get(tier)
        return 0.0 if gbps is None else self.block_bytes / (gbps * 1e9)


def estimate(result: ReplayResult, model: CostModel) -> dict[str, object]:
    """Bytes read from / written to each tier and the prefill seconds the hits save.

    A hit saves its block's recompute time minus its fetch time; an engine recomputes where
    fetching is slower (DESIGN: fetch only when it beats recompute), so a hit never saves less
    than zero. Every block counts ``block_tokens`` tokens, also a prompt's partial last block.
    """
    saved = {
        tier: hits * max(0.0, model.recompute_seconds - model.fetch_seconds(tier))
        for tier, hits in result.hits_by_tier.items()
    }
    total = result.prompt_blocks * model.recompute_seconds
    return {
        "bytes_read_by_tier": {t: n * model.block_bytes for t, n in result.read_blocks.items()},
        "bytes_written_by_tier": {t: n * model.block_bytes for t, n in result.written_blocks.items()},
        "prefill_seconds_total": total,
        "prefill_seconds_saved": sum(saved.values()),
        "prefill_seconds_saved_by_tier": saved,
    }
