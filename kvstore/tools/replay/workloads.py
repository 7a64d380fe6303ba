"""Synthetic Mooncake-format traces unlike the published ones, to check a policy off its tuning.

- ``zipf``: shared prefixes (system prompts, documents) drawn with Zipf popularity, each
  followed by a random suffix that is never asked for again.
- ``scan``: a small hot set of conversations re-asked all the time, mixed with a one-pass scan
  of long unique prompts (the pattern that floods LRU).
- ``loop``: the same long sequence of prompts cycled (LRU's worst case once it exceeds the tier).
- ``flood``: two tenants (lines name them): ``hot`` holds 20 multi-turn chats at a time over one
  8-block system prompt, each turn adding a block to its history, 8 to 15 turns a chat;
  ``flood`` sends 10 one-off 4-block prompts (2k tokens) per ``hot`` request. The
  noisy-neighbour pattern of docs/eviction.md's admission and quota tables.

``python -m kvstore.tools.replay.workloads zipf out.jsonl`` writes one; ``kvstore replay out.jsonl``
replays it. Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path


def zipf_prefixes(rng: random.Random, num_requests: int) -> Iterator[list[int]]:
    num_prefixes, alpha = 500, 1.0
    weights = [1.0 / (rank + 1) ** alpha for rank in range(num_prefixes)]
    prefix_ids, next_id = [], 0
    for _ in range(num_prefixes):
        length = rng.randint(2, 24)
        prefix_ids.append(list(range(next_id, next_id + length)))
        next_id += length
    for choice in rng.choices(range(num_prefixes), weights, k=num_requests):
        suffix = rng.randint(1, 16)
        yield prefix_ids[choice] + list(range(next_id, next_id + suffix))
        next_id += suffix


def hot_and_scan(rng: random.Random, num_requests: int) -> Iterator[list[int]]:
    hot = [list(range(i * 20, i * 20 + rng.randint(4, 20))) for i in range(60)]
    next_id = 60 * 20
    for _ in range(num_requests):
        if rng.random() < 0.5:
            yield rng.choice(hot)
        else:
            length = rng.randint(16, 64)
            yield list(range(next_id, next_id + length))
            next_id += length


def loop(rng: random.Random, num_requests: int) -> Iterator[list[int]]:
    prompts, next_id = [], 0
    for _ in range(400):
        length = rng.randint(4, 40)
        prompts.append(list(range(next_id, next_id + length)))
        next_id += length
    for i in range(num_requests):
        yield prompts[i % len(prompts)]


def flood_and_hot_set(rng: random.Random, num_requests: int) -> Iterator[tuple[list[int], str]]:
    system = list(range(8))
    next_id = 8
    chats: list[tuple[list[int], int]] = []  # (history ids, turns left)
    made = 0
    while made < num_requests:
        while len(chats) < 20:
            chats.append(([], rng.randint(8, 15)))
        i = rng.randrange(len(chats))
        history, left = chats[i]
        history = [*history, next_id]
        next_id += 1
        yield system + history, "hot"
        chats[i] = (history, left - 1)
        if left == 1:
            chats.pop(i)
        made += 1
        for _ in range(min(10, num_requests - made)):
            yield list(range(next_id, next_id + 4)), "flood"
            next_id += 4
            made += 1


WORKLOADS: dict[str, Callable[[random.Random, int], Iterator[list[int]] | Iterator[tuple[list[int], str]]]] = {
    "zipf": zipf_prefixes, "scan": hot_and_scan, "loop": loop, "flood": flood_and_hot_set,
}


def write_trace(name: str, path: Path, num_requests: int = 20_000, seed: int = 0) -> None:
    """Write workload ``name`` as a Mooncake-format trace (100 ms between requests)."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as out:
        for i, item in enumerate(WORKLOADS[name](rng, num_requests)):
            ids, tenant = item if isinstance(item, tuple) else (item, None)
            record: dict[str, object] = {"timestamp": i * 100, "input_length": len(ids) * 512 - 100,
                                         "output_length": 200, "hash_ids": ids}
            if tenant is not None:
                record["tenant"] = tenant
            out.write(json.dumps(record) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write a synthetic Mooncake-format trace")
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("out", type=Path)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_trace(args.workload, args.out, args.requests, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
