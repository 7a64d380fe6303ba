"""Model level, on the engine's CPU path with a tiny model of RANDOM WEIGHTS (it checks the
plumbing, not quality): the logits after a prefix fetched from an int8 disk against the logits
after the same prefix fetched raw. KL divergence and top-1 agreement are printed and bounded."""

from __future__ import annotations

from pathlib import Path

import torch

from kvstore import KVLayout, StoreConfig, TieredStore
from kvstore.engine import LLMEngine, SamplingParams

MODEL = dict(num_layers=4, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32,
             vocab_size=512, max_position_embeddings=512)
BLOCK = 4
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=BLOCK, dtype=torch.float32)
PREFIX = [(7 * i + 3) % 512 for i in range(64)]  # 16 blocks
SUFFIXES = [[(11 * j + k) % 512 for k in range(1 + j % 3)] for j in range(12)]


def _next_token_logits(tmp_path: Path, codec: str) -> tuple[torch.Tensor, dict[str, int]]:
    """Logits of each ``PREFIX + suffix``'s last token, the prefix read back from a disk tier
    written under ``codec`` (a fresh store and engine: every prefix block is on disk only)."""
    def open_store() -> TieredStore:
        return TieredStore(StoreConfig(layout=LAYOUT, model_id="random", host_bytes=64 * LAYOUT.bytes_per_block,
                                       disk_path=tmp_path / codec, disk_bytes=64 * LAYOUT.bytes_per_block,
                                       disk_codec=codec, sync_disk=False))

    def engine(store: TieredStore) -> LLMEngine:
        return LLMEngine(None, random_model=MODEL, dtype=torch.float32, block_size=BLOCK,
                         kv_cache_bytes=64 * LAYOUT.bytes_per_block, fetch_policy="always", store=store)

    store = open_store()
    llm = engine(store)
    llm.generate([[*PREFIX, 1]], SamplingParams(max_tokens=1, temperature=0.0))
    llm.close()  # device cache -> store
    store.close()  # host -> disk, encoded
    store = open_store()
    assert store.lookup(store.block_keys(PREFIX)).tiers == ("disk",) * 16
    llm = engine(store)
    rows: list[torch.Tensor] = []
    model_logits = llm.model.logits

    def record(hidden: torch.Tensor) -> torch.Tensor:  # the logits the engine computes, kept
        out = model_logits(hidden)
        rows.append(out.detach().cpu().clone())
        return out

    llm.model.logits = record  # type: ignore[method-assign]
    cached = {"disk": 0}
    for suffix in SUFFIXES:  # one prompt at a time: each step's single logits row is its last token's
        out = llm.generate([[*PREFIX, *suffix]], SamplingParams(max_tokens=1, temperature=0.0))[0]
        cached["disk"] += out.metrics.cached_tokens["disk"] + out.metrics.cached_tokens["host"]
        llm.evict_device_cache()
    llm.close()
    store.close()
    return torch.cat(rows), cached


def test_int8_prefix_blocks_vs_raw_random_weights(tmp_path: Path) -> None:
    raw, raw_cached = _next_token_logits(tmp_path, "none")
    int8, int8_cached = _next_token_logits(tmp_path, "int8")
    assert raw.shape == int8.shape == (len(SUFFIXES), 512)
    assert raw_cached == int8_cached == {"disk": len(SUFFIXES) * len(PREFIX)}, (raw_cached, int8_cached)
    p = torch.log_softmax(raw.double(), dim=-1)
    q = torch.log_softmax(int8.double(), dim=-1)
    kl = (p.exp() * (p - q)).sum(dim=-1)
    top1 = (raw.argmax(-1) == int8.argmax(-1)).double().mean().item()
    print(f"int8 vs raw prefix blocks: KL mean {kl.mean():.3g} max {kl.max():.3g} nats, top-1 agreement {top1:.3f}, "
          f"max |logit diff| {(raw - int8).abs().max():.3g}")
    assert float(kl.max()) < 1e-3 and top1 >= 11 / 12
    assert not torch.equal(raw, int8), "int8 blocks decoded bit-identical: the codec did not run"
