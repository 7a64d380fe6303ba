"""``kvstore bench tenants``: no noisy neighbours, measured through one real daemon.

Tenant B runs multi-turn chats over one hot system prompt through the real engine
(SmolLM2-135M-Instruct by default; ``--model``, ``--random-model``, ``--tiny``) whose store is a ``kvstore serve`` process
(B's token); its device pool holds about one prompt, so a returning chat finds its prefix in
the daemon or recomputes it; it fetches every hit (``fetch_policy="always"``), so its hit
ratio is what the daemon kept, not its cost model's choice between fetch and recompute. Tenant A floods one-off 2k-token prompts (a lookup, then a put of
every block, as an engine would) at ``--flood-ratio`` times B's request rate, with another
token of the same tokens file, into the same namespace (the same model and KV layout). Three
arms, each run on a fresh daemon with the same prompts, interleaved over ``--rounds``:

- B alone (the daemon's default: equal soft shares for the tokens file's tenants);
- B with A, equal soft quotas (the default);
- B with A, no quotas (``--default-quotas none``: one shared eviction order).

Reported: B's hit ratio (prompt tokens served from the device pool or the daemon over all
prompt tokens), its daemon hit ratio (tokens the daemon served over those the device pool
lacked: what a neighbour can take away), and B's TTFT (median and p90 over its turns after a
chat's first, pooled over the rounds, with the spread of the rounds' medians), each with A
against without; the target is a hit ratio with A and quotas >= 90% of B's alone. Hit ratios
are deterministic (the same in every round); TTFTs move with the machine's load.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstore.engine.checkpoint import CheckpointError
from kvstore.errors import ConfigError
from kvstore.services.common.argtypes import positive
from kvstore.services.common.sizes import format_size, parse_size
from kvstore.tools.bench.harness import machine, start_service
from kvstore.tools.bench.models import BenchModel, add_model_arguments
from kvstore.tools.bench.output import add_output_arguments, publish

BLOCK = 16
# --random-model: 8 layers, 2 KV heads of 64, float32: 128 KiB per 16-token block (a 2k prompt: 16 MiB)
RANDOM_MODEL: dict[str, Any] = dict(num_layers=8, hidden_size=256, intermediate_size=512, num_heads=4,
                                   num_kv_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=8192)
TINY_MODEL: dict[str, Any] = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=2,
                                  num_kv_heads=1, head_dim=32, vocab_size=512, max_position_embeddings=4096)
TOKENS = {"a": "tok-bench-flood", "b": "tok-bench-chat"}
ARMS = (("B alone", False, "equal"), ("B + A, equal soft quotas", True, "equal"),
        ("B + A, no quotas", True, "none"))
TARGET = 0.9  # B's hit ratio with A and quotas, as a share of B's alone
HOST_BLOCKS = 768  # the daemon's default host RAM, in blocks of B's model (SmolLM2: 540 MiB)


@dataclass
class ArmResult:
    name: str
    prompt_tokens: int = 0
    cached: dict[str, int] = field(default_factory=dict)
    ttfts: list[float] = field(default_factory=list)
    flood_blocks: int = 0
    seconds: float = 0.0
    daemon: dict[str, Any] = field(default_factory=dict)  # the namespace's tiers at the end
    round_medians: list[float] = field(default_factory=list)  # TTFT median of each round (s)

    @property
    def hit_ratio(self) -> float:
        return sum(self.cached.values()) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def daemon_hit_ratio(self) -> float:
        """Tokens the daemon served over the prompt tokens the device pool did not have."""
        asked = self.prompt_tokens - self.cached.get("device", 0)
        served = sum(n for tier, n in self.cached.items() if tier != "device")
        return served / asked if asked else 0.0

    def merge(self, other: ArmResult) -> None:
        """Another round of the same arm: hit counts must agree (the workload is fixed)."""
        if self.prompt_tokens and (other.prompt_tokens, other.cached) != (self.prompt_tokens, self.cached):
            print(f"{self.name}: hit counts differ between rounds: {self.cached} vs {other.cached}", file=sys.stderr)
        self.prompt_tokens, self.cached, self.flood_blocks = other.prompt_tokens, other.cached, other.flood_blocks
        self.ttfts += other.ttfts
        self.seconds += other.seconds
        self.daemon = other.daemon
        if other.ttfts:
            self.round_medians.append(sorted(other.ttfts)[len(other.ttfts) // 2])

    def ttft_ms(self, q: float) -> float:
        if not self.ttfts:
            return 0.0
        ordered = sorted(self.ttfts)
        return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Daemon:
    """A ``kvstore serve`` process, host RAM only, one namespace, the bench's tokens."""

    def __init__(self, root: Path, host_bytes: int, default_quotas: str) -> None:
        tokens = root / "tokens.toml"
        tokens.write_text("".join(f'[[tenant]]\nname = "{name}"\ntokens = ["{tok}"]\n\n' for name, tok in TOKENS.items()))
        self.socket = root / "kv.sock"
        cmd = [sys.executable, "-m", "kvstore.services.daemon", "serve", "--data-dir", str(root / "data"),
               "--disk-size", "0", "--host-mem", str(host_bytes), "--max-namespaces", "1",
               "--socket", str(self.socket), "--listen", "", "--http", "", "--tokens", str(tokens),
               "--default-quotas", default_quotas]
        self.proc, _ = start_service(cmd, "the daemon")

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@dataclass(frozen=True)
class Workload:
    chats: int
    turns: int
    system_tokens: int
    user_tokens: int
    reply_tokens: int
    flood_ratio: int
    flood_tokens: int
    vocab: int
    seed: int = 0


def run_arm(name: str, flood: bool, quotas: str, work: Workload, model: BenchModel, host_bytes: int,
            device_blocks: int) -> ArmResult:
    """One run on a fresh daemon: B's chats, with A's flood before each B turn when ``flood``."""
    from kvstore import connect
    from kvstore.engine.sampling import SamplingParams

    result = ArmResult(name)
    rng = random.Random(work.seed)
    system = [rng.randrange(1, work.vocab) for _ in range(work.system_tokens)]
    users = [[[rng.randrange(1, work.vocab) for _ in range(work.user_tokens)] for _ in range(work.turns)]
             for _ in range(work.chats)]
    flood_rng = random.Random(work.seed + 1)
    with tempfile.TemporaryDirectory(prefix="kv-bench-tenants-") as tmp:
        daemon = Daemon(Path(tmp), host_bytes, quotas)
        try:
            llm = model.engine(dtype=torch.float32, block_size=BLOCK,
                               kv_cache_bytes=device_blocks * _block_bytes(model), store_url=daemon.url,
                               store_token=TOKENS["b"], fetch_policy="always")
            a = connect(daemon.url, TOKENS["a"], layout=llm.layout, model_id=llm.model_id) if flood else None
            flood_blocks = work.flood_tokens // BLOCK
            rows = torch.zeros((flood_blocks, *llm.layout.block_shape), dtype=llm.layout.dtype)
            reply = SamplingParams(max_tokens=work.reply_tokens, temperature=0.0, ignore_eos=True)
            warm = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, skip_reading_prefix_cache=True)
            for _ in range(2):  # thread pools, allocator, first kernel calls: not in B's first TTFTs
                llm.generate([[1] * (work.system_tokens + 2 * BLOCK)], warm, tenant="warm-up")
            histories = [list(system) for _ in range(work.chats)]
            started = time.perf_counter()
            for turn in range(work.turns):
                for chat in range(work.chats):
                    if a is not None:
                        for _ in range(work.flood_ratio):
                            tokens = [flood_rng.randrange(1, work.vocab) for _ in range(work.flood_tokens)]
                            keys = a.block_keys(tokens)
                            a.lookup(keys)
                            a.put(keys, rows)
                            result.flood_blocks += len(keys)
                    prompt = histories[chat] + users[chat][turn]
                    out = llm.generate([prompt], reply)[0]
                    m = out.metrics
                    result.prompt_tokens += m.num_prompt_tokens
                    for tier, n in m.cached_tokens.items():
                        result.cached[tier] = result.cached.get(tier, 0) + n
                    if turn > 0:  # a chat's first turn is cold in every arm
                        result.ttfts.append(m.ttft_s or 0.0)
                    histories[chat] = prompt + out.outputs[0].token_ids
            result.seconds = time.perf_counter() - started
            result.daemon = _usage(llm)
            if a is not None:
                a.close()
            llm.close()
        finally:
            daemon.stop()
    return result


def _usage(llm: Any) -> dict[str, Any]:
    """The daemon's per-tier stats of the namespace, as B's client sees them."""
    try:
        return dict(llm.store.stats())
    except Exception:  # a bench figure, not a failure
        return {}


def _block_bytes(model: BenchModel) -> int:
    return int(model.layout(BLOCK, torch.float32).bytes_per_block)


def render(results: list[ArmResult], work: Workload, model: BenchModel, host_bytes: int,
           device_blocks: int, where: str) -> str:
    alone = results[0]
    lines = [
        "## Tenants: no noisy neighbours (`kvstore bench tenants`)",
        "",
        f"Machine: {where}. One `kvstore serve` (host RAM {format_size(host_bytes)}, no disk, one namespace), "
        f"tokens for tenants a and b. B: the engine on {model.describe()}, float32 KV "
        f"({_block_bytes(model) // 1024} KiB per {BLOCK}-token block), device pool of {device_blocks} blocks, store = the daemon (every hit fetched); "
        f"{work.chats} chats x "
        f"{work.turns} turns over one {work.system_tokens}-token system prompt, {work.user_tokens} user tokens "
        f"and {work.reply_tokens} reply tokens a turn. A: {work.flood_ratio} one-off {work.flood_tokens}-token "
        f"prompts (lookup + put of every block) before each of B's requests. Same prompts in every run.",
        "",
        "| run | B hit ratio | vs B alone | B daemon hit ratio | cached on device / in the daemon (tokens) "
        "| B TTFT median (rounds) | B TTFT p90 | A blocks put per round | run time |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        share = r.hit_ratio / alone.hit_ratio if alone.hit_ratio else 0.0
        daemon_tokens = sum(n for t, n in r.cached.items() if t != "device")
        spread = ", ".join(f"{1e3 * m:.0f}" for m in r.round_medians)
        lines.append(f"| {r.name} | {r.hit_ratio:.3f} | {share:.1%} | {r.daemon_hit_ratio:.3f} "
                     f"| {r.cached.get('device', 0)} / {daemon_tokens} | {r.ttft_ms(0.5):.1f} ms ({spread}) "
                     f"| {r.ttft_ms(0.9):.1f} ms | {r.flood_blocks} | {r.seconds:.0f} s |")
    quota = results[1].hit_ratio / alone.hit_ratio if alone.hit_ratio else 0.0
    met = "met" if quota >= TARGET else "NOT met"
    lines += ["", f"Target: B's hit ratio with A under equal soft quotas >= {TARGET:.0%} of B's alone: "
              f"{quota:.1%}, {met}. Without quotas B keeps "
              f"{results[2].hit_ratio / alone.hit_ratio if alone.hit_ratio else 0.0:.1%} of it, and its daemon hit "
              f"ratio falls from {alone.daemon_hit_ratio:.3f} to {results[2].daemon_hit_ratio:.3f} (the device pool "
              "keeps the hot system prompt either way). TTFT: every turn after a chat's first, pooled over the "
              "rounds (the arms interleaved, their order rotated each round, a fresh daemon each run); in brackets each round's median, in ms: "
              "the spread a shared machine leaves."]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.tiny and args.model:
        raise SystemExit("kvstore bench tenants: --tiny is a random model; it takes no --model")
    if args.tiny:
        args.random_model = True
    try:
        model = BenchModel.from_args(args, random=TINY_MODEL if args.tiny else RANDOM_MODEL)
        model.config  # noqa: B018  (a missing or unreadable model fails here, not halfway)
    except CheckpointError as exc:
        print(f"kvstore bench tenants: {exc}", file=sys.stderr)
        return 2
    work = Workload(args.chats, args.turns, args.system_tokens, args.user_tokens, args.reply_tokens,
                    args.flood_ratio, args.flood_tokens, model.vocab_size)
    longest = work.system_tokens + work.turns * (work.user_tokens + work.reply_tokens)
    device_blocks = args.device_blocks or -(-longest // BLOCK) + 8
    host_bytes = args.host_mem or HOST_BLOCKS * _block_bytes(model)
    results = [ArmResult(name) for name, _, _ in ARMS]
    for round_ in range(args.rounds):
        order = [(round_ + i) % len(ARMS) for i in range(len(ARMS))]  # rotated: no arm always runs first
        for i in order:
            name, flood, quotas = ARMS[i]
            print(f"round {round_ + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
            results[i].merge(run_arm(name, flood, quotas, work, model, host_bytes, device_blocks))
    text = render(results, work, model, host_bytes, device_blocks, machine())
    publish(args, "tenants", text)
    return 0


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register_target(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("tenants", help="a chat tenant's hit ratio and TTFT beside a flooding tenant, "
                           "with and without quotas, through one daemon",
                           description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--chats", type=positive(int), default=4, help="B's chats, taking turns (default 4)")
    p.add_argument("--turns", type=positive(int), default=8, help="turns per chat (default 8)")
    p.add_argument("--system-tokens", type=positive(int), default=512, help="B's system prompt (default 512)")
    p.add_argument("--user-tokens", type=positive(int), default=32, help="tokens of each user turn (default 32)")
    p.add_argument("--reply-tokens", type=positive(int), default=16, help="tokens of each reply (default 16)")
    p.add_argument("--flood-ratio", type=positive(int), default=10, help="A's prompts per B request (default 10)")
    p.add_argument("--flood-tokens", type=positive(int), default=2048, help="tokens of A's prompts (default 2048)")
    p.add_argument("--host-mem", type=_size, default=None,
                   help=f"the daemon's host RAM (default {HOST_BLOCKS} of B's blocks: 540MiB for SmolLM2)")
    p.add_argument("--device-blocks", type=positive(int), default=None,
                   help="B's device pool in blocks (default: its longest prompt and 8)")
    p.add_argument("--rounds", type=positive(int), default=2, help="runs of each arm, interleaved (default 2)")
    add_model_arguments(p)
    p.add_argument("--tiny", action="store_true", help="a 2-layer random model (tests: seconds, not minutes)")
    add_output_arguments(p)
    p.set_defaults(func=run)
