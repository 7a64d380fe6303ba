"""The tiers a replica reports, their bits in the index, and what a hit in each is worth.

A hit in a lower tier still saves prefill, but less than a device hit: the block must be
fetched first. A tier's weight is the share of the recompute time a hit saves,
``1 - fetch seconds per token / recompute seconds per token`` (at least 0); the device tier
weighs 1. ``ROUTED`` is the router's own guess (a prefix it sent to a replica and has not yet
seen in that replica's events, or everything in approximate mode): it will be on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Event ``medium`` names (vLLM's for the device and host tiers) -> index bits.
GPU, CPU, DISK, REMOTE, ROUTED = "GPU", "CPU", "DISK", "REMOTE", "ROUTED"
MEDIA = (GPU, CPU, DISK, REMOTE)
TIERS = (*MEDIA, ROUTED)
BITS = {name: 1 << i for i, name in enumerate(TIERS)}
ALL_MEDIA_BITS = BITS[GPU] | BITS[CPU] | BITS[DISK] | BITS[REMOTE]
# Guesses live in two generations (history.py): ROUTED holds the current one, this bit the
# previous one; both count as the ROUTED tier.
ROUTED_OLD_BIT = 1 << len(TIERS)
ROUTED_BITS = BITS[ROUTED] | ROUTED_OLD_BIT

# Round figures (docs/routing.md): PCIe 4.0 x16 host copies, one NVMe drive, a 25 GbE link;
# an 8B model's prefill on one datacenter GPU; Llama-3-8B fp16 KV (32 x 8 x 128 x 2 x 2 bytes).
HOST_GBPS, DISK_GBPS, REMOTE_GBPS = 20.0, 3.0, 2.5
PREFILL_TOKENS_PER_S = 10_000.0
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2


def medium_bit(medium: str) -> int:
    """The index bit of an event medium; ValueError naming the known ones."""
    if medium not in MEDIA:
        raise ValueError(f"unknown medium {medium!r}; known: {', '.join(MEDIA)}")
    return BITS[medium]


@dataclass(frozen=True)
class TierWeights:
    """The share of a block's prefill that a hit in each tier saves, in [0, 1].

    The defaults are ``from_costs()`` at its defaults, rounded.
    """

    gpu: float = 1.0
    cpu: float = 0.93
    disk: float = 0.56
    remote: float = 0.48

    def __post_init__(self) -> None:
        for name in ("gpu", "cpu", "disk", "remote"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise ValueError(f"tier weight {name} must be a number in [0, 1], got {value!r}")

    @classmethod
    def from_costs(cls, kv_bytes_per_token: int = KV_BYTES_PER_TOKEN,
                   prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S, host_gbps: float = HOST_GBPS,
                   disk_gbps: float = DISK_GBPS, remote_gbps: float = REMOTE_GBPS) -> TierWeights:
        """Weights from fetch cost vs recompute: ``1 - (bytes/token / bandwidth) * prefill rate``."""
        if kv_bytes_per_token <= 0 or prefill_tokens_per_s <= 0:
            raise ValueError(f"need positive KV bytes per token and prefill rate, got "
                             f"{kv_bytes_per_token} and {prefill_tokens_per_s}")

        def saved(gbps: float) -> float:
            if gbps <= 0:
                raise ValueError(f"tier bandwidths must be positive, got {gbps} GB/s")
            return max(0.0, 1.0 - kv_bytes_per_token / (gbps * 1e9) * prefill_tokens_per_s)

        return cls(1.0, saved(host_gbps), saved(disk_gbps), saved(remote_gbps))

    def by_medium(self) -> dict[str, float]:
        return {GPU: self.gpu, CPU: self.cpu, DISK: self.disk, REMOTE: self.remote, ROUTED: self.gpu}

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """For every mask byte: the weight of its best tier and that tier's index in TIERS.

        A mask with no bit set weighs 0 (its tier index is len(TIERS)).
        """
        weights = self.by_medium()
        weight_of = np.zeros(256, dtype=np.float64)
        tier_of = np.full(256, len(TIERS), dtype=np.int64)
        for mask in range(1, 256):
            bits = mask | BITS[ROUTED] if mask & ROUTED_OLD_BIT else mask
            held = [(weights[t], -i, i) for i, t in enumerate(TIERS) if bits & BITS[t]]
            if held:
                best = max(held)
                weight_of[mask], tier_of[mask] = best[0], best[2]
        return weight_of, tier_of
