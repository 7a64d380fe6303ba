"""``kvstore demo``: a multi-turn chat workload through the engine on a random small model.

Several users share a system prompt; each turn's prompt is the whole conversation so far. The
device pool and the host tier are deliberately small, so a conversation that comes back finds
its prefix pushed down to host RAM or to disk; a restart halfway shows the disk tier outliving
the process. Each turn prints its TTFT and where the prompt's tokens came from.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from pathlib import Path

import torch

from kvstore.engine.llm import LLMEngine
from kvstore.engine.sampling import SamplingParams
from kvstore.layout import KVLayout

DEMO_MODEL = dict(num_layers=8, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                  head_dim=64, vocab_size=4096, max_position_embeddings=4096)
BLOCK = 16
SYSTEM_TOKENS = 200
MESSAGE_TOKENS = (30, 120)  # a user message's length: randrange(30, 120)


def longest_conversation(args: argparse.Namespace) -> int:
    """Blocks the longest possible conversation holds at its last generated token."""
    tokens = SYSTEM_TOKENS + args.turns * (MESSAGE_TOKENS[1] - 1 + args.reply_tokens)
    return -(-tokens // BLOCK)


def open_engine(args: argparse.Namespace, disk: Path) -> LLMEngine:
    probe = KVLayout(DEMO_MODEL["num_layers"], DEMO_MODEL["num_kv_heads"], DEMO_MODEL["head_dim"], BLOCK,
                     torch.float32).bytes_per_block
    return LLMEngine(None, random_model=DEMO_MODEL, dtype=torch.float32, block_size=BLOCK,
                     kv_cache_bytes=args.device_blocks * probe, host_bytes=args.host_blocks * probe,
                     disk_path=disk, disk_bytes=args.disk_blocks * probe, fetch_policy=args.fetch_policy)


def print_tiers(llm: LLMEngine) -> None:
    for name, s in llm.stats().items():
        if "capacity_bytes" not in s:
            continue
        used = s["used_bytes"] / max(1, s["capacity_bytes"])
        bar = "#" * round(30 * used) + "." * (30 - round(30 * used))
        extra = (f"hits {s['hits']:>4}  evictions {s['evictions']:>4}" if "hits" in s
                 else f"in use {s['num_in_use']:>3}  demoted {s['demoted']:>4}")
        print(f"  {name:<6} [{bar}] {s['num_blocks']:>5} blocks  {extra}")


def run(args: argparse.Namespace) -> int:
    need = longest_conversation(args)
    if args.device_blocks is None:
        args.device_blocks = need  # one whole conversation: the others are pushed down the tiers
    elif args.device_blocks < need:
        print(f"kvstore demo: --device-blocks {args.device_blocks} is too small: a conversation of "
              f"{args.turns} turns can reach {need} blocks of {BLOCK} tokens, and a prompt must fit the "
              f"device pool; raise --device-blocks or lower --turns", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    disk = Path(args.data_dir) / "engine-demo"
    if args.fresh and disk.exists():
        shutil.rmtree(disk)
    disk.parent.mkdir(parents=True, exist_ok=True)
    vocab = int(DEMO_MODEL["vocab_size"])
    system_prompt = [rng.randrange(vocab) for _ in range(SYSTEM_TOKENS)]
    histories = {f"user{u}": list(system_prompt) for u in range(args.users)}
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0.8, top_k=50, seed=args.seed, ignore_eos=True)
    llm = open_engine(args, disk)
    print(f"kvstore demo: {args.users} users x {args.turns} turns on a random {DEMO_MODEL['num_layers']}-layer model; "
          f"device {args.device_blocks} / host {args.host_blocks} / disk {args.disk_blocks} blocks of {BLOCK} "
          f"tokens; fetch_policy={args.fetch_policy}; disk tier at {disk}")
    print(f"{'':>9} {'turn':>4} {'user':<6} {'prompt':>6} {'TTFT ms':>8}  {'device':>6} {'host':>6} "
          f"{'disk':>6} {'computed':>8}   (tokens)")
    totals = {"device": 0, "host": 0, "disk": 0, "computed": 0}
    total_turns, done = args.users * args.turns, 0
    t_start = time.perf_counter()
    for turn in range(args.turns):
        if turn == args.turns // 2 and turn > 0:
            llm.close()
            print("-- restart: the engine closes (device and host KV written back) and reopens on the same disk --")
            llm = open_engine(args, disk)
        for user, history in histories.items():
            history.extend(rng.randrange(vocab) for _ in range(rng.randrange(*MESSAGE_TOKENS)))  # the user's message
            out = llm.generate([history], params, tenant="demo")[0]
            m = out.metrics
            computed = m.num_prompt_tokens - sum(m.cached_tokens.values())
            for tier in ("device", "host", "disk"):
                totals[tier] += m.cached_tokens[tier]
            totals["computed"] += computed
            done += 1
            print(f"[{done:>3}/{total_turns}] {turn:>4} {user:<6} {m.num_prompt_tokens:>6} {1e3 * (m.ttft_s or 0):>8.1f}  "
                  f"{m.cached_tokens['device']:>6} {m.cached_tokens['host']:>6} {m.cached_tokens['disk']:>6} "
                  f"{computed:>8}", flush=True)
            history.extend(out.token_ids)  # the reply joins the conversation
    elapsed = time.perf_counter() - t_start
    served = sum(totals.values())
    print(f"prompt tokens: {served}; from device {totals['device']}, host {totals['host']}, disk {totals['disk']}, "
          f"computed {totals['computed']} ({100 * totals['computed'] / max(1, served):.0f}%); {elapsed:.1f} s")
    print("tier occupancy:")
    print_tiers(llm)
    llm.check_integrity()
    llm.close()
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device-blocks", type=int, default=None,
                        help="device KV pool in blocks (default: the longest conversation's, 67 with the defaults)")
    parser.add_argument("--reply-tokens", type=int, default=24, help="tokens generated per turn (default 24)")
    parser.add_argument("--fetch-policy", default="auto", choices=("auto", "always", "never"),
                        help="when to fetch lower-tier prefixes instead of recomputing (default auto)")
