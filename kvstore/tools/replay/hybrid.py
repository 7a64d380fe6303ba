"""A trace through the tiers as a hybrid model's KV groups: ``kvstore replay --layout``.

Every trace block becomes one block per KV group, keyed (block, group), of 1/G the bytes of
an all-layers block (``GroupLayout.group_blocks_per_block``); tier capacities stay in
all-layers blocks, so a tier of C blocks holds C x G group blocks: the same bytes as C blocks
of today's replay (``sim.replay``), which is the baseline. Per request of L blocks (cut to
the top tier's capacity, as ``sim`` cuts), as the engine does (kvstore/engine/group_hits.py):

1. Hit: the longest boundary n at which every group has what a hit needs in some tier: a
   full group its blocks 0 .. n - 1, a sliding group of w window blocks (``KVGroup.
   window_blocks`` at the trace's block size) its blocks n - w .. n - 1 (``hit_boundary``).
   Each hit block is credited to the lowest tier one of its needed group blocks came from.
2. Fetch: the needed group blocks below the top tier are read up (an ``access`` there).
   A sliding block below the hit's window is never read: the hit does not use it.
3. Place: the top tier holds every group block the request used or computed: full groups'
   blocks 0 .. L - 1, sliding groups' n - w .. L - 1 (those below are neither computed nor
   put). Room is made first (victims demoted down the cascade as in ``sim``); then each group,
   in layout order, is accessed or inserted segment by segment from the tail.
4. Cool: the request ended at boundary m; each sliding group's held blocks below its window
   there are cooled (``EvictionPolicy.cool``, in every tier holding them), except those in
   the window of the hit's boundary n. A later use warms a block; a cooled block that a tier
   evicts is written to the tier below only under ``cold_blocks="demote"`` (under "drop" it
   leaves that tier), at every level, as ``Cascade`` does.

Where a request ends (``cool_at``): the engine caches full blocks only, so by default m is the
request's full prompt blocks, ``input_length // block_tokens`` (L where a line has no length);
a trace's last id is mostly a partial block, and the next turn of a conversation shares the
prompt up to just before it. ``"last-block"`` takes m = L instead: every id a block.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.config import COLD_BLOCKS
from kvstore.errors import ConfigError
from kvstore.layout import FULL, SLIDING, KVGroup, group_layers
from kvstore.policy.eviction import EvictionPolicy, Key, make_policy
from kvstore.tools.replay.sim import TierSpec
from kvstore.tools.replay.trace import ReplayError, Trace

FULL_LAYOUT = "full"
GEMMA3_270M = "gemma3-270m"
COOL_AT = ("full-blocks", "last-block")
_TERM = re.compile(r"(\d+)(f|s(\d+))")


@dataclass(frozen=True)
class GroupLayout:
    """A replayed model's KV groups and the size of a group block: 1/``group_blocks_per_block``
    of an all-layers block."""

    name: str
    groups: tuple[KVGroup, ...]
    group_blocks_per_block: int

    def windows(self, block_tokens: int) -> list[int | None]:
        """Per group, the blocks a hit needs ending at its boundary (None: every block)."""
        return [g.window_blocks(block_tokens) for g in self.groups]

    def describe(self, block_tokens: int) -> str:
        full = sum(g.kind == FULL for g in self.groups)
        sliding = sorted({(g.window, w) for g, w in zip(self.groups, self.windows(block_tokens), strict=True)
                          if g.window is not None and w is not None})
        parts = [f"{full} full"] + [f"{sum(g.window == tokens for g in self.groups)} sliding, W = {tokens} "
                                    f"tokens = {w} block{'s' * (w != 1)} of {block_tokens}" for tokens, w in sliding]
        return f"{self.name}: {len(self.groups)} KV groups ({', '.join(parts)}), a group block 1/" \
               f"{self.group_blocks_per_block} of an all-layers block"


def parse_layout(spec: str) -> GroupLayout | None:
    """``--layout``: ``full`` (None: today's replay), ``gemma3-270m`` (18 layers, every 6th full,
    the rest sliding with W = 512: ``group_layers`` makes 5 sliding groups and 1 full one of 3
    layers), or ``groups:TERM+TERM...``, a term being ``<count>f`` (full attention) or
    ``<count>s<W>`` (sliding, W tokens), each group a 1/G share of the all-layers block.

    Raises:
        ReplayError: an unknown name or a malformed term (the message shows the grammar).
    """
    if spec == FULL_LAYOUT:
        return None
    if spec == GEMMA3_270M:
        num_layers = 18
        slots, gemma = group_layers([(FULL, None) if i % 6 == 5 else (SLIDING, 512) for i in range(num_layers)])
        assert num_layers % slots == 0, "Gemma-3-270M's groups fill their layer slots"
        return GroupLayout(spec, gemma, num_layers // slots)
    grammar = (f"--layout must be {FULL_LAYOUT}, {GEMMA3_270M} or groups:TERM[+TERM...] with TERM <count>f "
               f"(full attention) or <count>s<W> (sliding window of W tokens), e.g. groups:1f+5s512; got {spec!r}")
    if not spec.startswith("groups:"):
        raise ReplayError(grammar)
    groups: list[KVGroup] = []
    for term in spec[len("groups:"):].split("+"):
        match = _TERM.fullmatch(term)
        if match is None or int(match[1]) < 1:
            raise ReplayError(grammar)
        window = int(match[3]) if match[3] is not None else None
        for _ in range(int(match[1])):
            try:
                groups.append(KVGroup(FULL if window is None else SLIDING, (len(groups),), window))
            except ConfigError as exc:
                raise ReplayError(f"--layout {spec}: {exc}") from None
    return GroupLayout(spec, tuple(groups), len(groups))


@dataclass
class GroupReplayResult:
    """What one policy did with one layout on one tier configuration. Block counts are group
    blocks unless named otherwise; ``hits`` and ``prompt_blocks`` are trace (all-layers) blocks."""

    policy: str
    layout: str
    tiers: tuple[TierSpec, ...]
    cold_blocks: str
    group_blocks_per_block: int
    num_requests: int
    prompt_blocks: int
    hits: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)  # hit blocks by the lowest tier they needed
    read_blocks: dict[str, int] = field(default_factory=dict)  # group blocks fetched up from this tier
    written_blocks: dict[str, int] = field(default_factory=dict)  # group blocks demoted into this tier
    dropped_blocks: int = 0  # group blocks that left the last tier holding them
    cooled_blocks: int = 0  # held group blocks cooled while warm (cooling a cold one again does not count)
    cold_dropped_blocks: int = 0  # cooled group blocks kept out of the tier below by "drop"
    seconds: float = 0.0

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.prompt_blocks if self.prompt_blocks else 0.0

    def tier_group_blocks(self) -> dict[str, int]:
        """Each tier's capacity in group blocks: the same bytes as its all-layers blocks."""
        return {t.name: t.capacity_blocks * self.group_blocks_per_block for t in self.tiers}


def hit_boundary(num_blocks: int, full: Sequence[int], sliding: Sequence[tuple[int, int]],
                 present: Callable[[int, int], bool]) -> int:
    """The longest boundary n <= ``num_blocks`` at which every group has what a hit needs
    (``present(g, i)``: group g's block i is in some tier): the full groups' leading runs bound
    it, then it shrinks to below any missing block of a sliding window ``(g, w)`` ending at it.
    The engine's rule (kvstore/engine/groups.py, ``DeviceGroups.reconcile``)."""
    n = num_blocks
    for g in full:
        run = 0
        while run < n and present(g, run):
            run += 1
        n = run
    while n > 0:
        missing = -1  # the last block some window ending at n lacks
        for g, w in sliding:
            for i in range(n - 1, max(0, n - w) - 1, -1):
                if not present(g, i):
                    missing = max(missing, i)
                    break
        if missing < 0:
            return n
        n = missing
    return 0


def _outside(in_use: frozenset[int]) -> Callable[[Key], bool]:
    def can_evict(key: Key) -> bool:  # a request's own blocks are in use: never victims
        return key not in in_use

    return can_evict


def replay_groups(trace: Trace, tiers: Sequence[TierSpec], policy: str, layout: GroupLayout,
                  cold_blocks: str = "demote", block_tokens: int = 512, cool_at: str = COOL_AT[0],
                  progress: Callable[[int], None] | None = None) -> GroupReplayResult:
    """Replay ``trace`` as ``layout``'s KV groups through ``tiers`` (top first, capacities in
    all-layers blocks), one ``policy`` instance per tier; every tier admits all. ReplayError
    for an unknown policy, ``cold_blocks`` or ``cool_at``."""
    if cold_blocks not in COLD_BLOCKS:
        raise ReplayError(f"cold_blocks must be one of {list(COLD_BLOCKS)}, got {cold_blocks!r}")
    if cool_at not in COOL_AT:
        raise ReplayError(f"cool_at must be one of {list(COOL_AT)}, got {cool_at!r}")
    try:
        policies: list[EvictionPolicy] = [make_policy(policy) for _ in tiers]
    except ValueError as exc:
        raise ReplayError(str(exc)) from None
    started = time.perf_counter()
    num_groups, demote_cold = len(layout.groups), cold_blocks == "demote"
    windows = layout.windows(block_tokens)
    full = [g for g, w in enumerate(windows) if w is None]
    sliding = [(g, w) for g, w in enumerate(windows) if w is not None]
    # Group key of block id b, group g: b * G + g (ints hash fast); the parent is block b's parent's.
    ids: dict[bytes, int] = {}
    chains = [[ids.setdefault(k, len(ids)) for k in chain] for chain in trace.chains]
    parent_ids = [-1] * len(ids)
    for chain_key, b in ids.items():
        parent = trace.parents.get(chain_key)
        parent_ids[b] = ids[parent] if parent is not None else -1

    def parent_of(key: int) -> int | None:
        b, g = divmod(key, num_groups)
        return None if parent_ids[b] < 0 else parent_ids[b] * num_groups + g

    num_tiers = len(tiers)
    caps = [t.capacity_blocks * layout.group_blocks_per_block for t in tiers]
    sizes = [0] * num_tiers
    where: dict[int, int] = {}  # group key -> bit mask of the tiers holding it (bit 0 = top)
    cold: set[int] = set()  # held group keys cooled and not used since
    hits_by_tier, reads, writes = [0] * num_tiers, [0] * num_tiers, [0] * num_tiers
    hits = dropped = cooled = cold_dropped = 0

    def make_room(tier: int, count: int, can_evict: Callable[[Key], bool] | None) -> None:
        # Victims come tail first; the tier below gets them as one batch in chain order.
        nonlocal dropped, cold_dropped
        victims = [policies[tier].pop_victim(can_evict) for _ in range(count)]
        assert None not in victims, f"tier {tiers[tier].name}: nothing evictable at {sizes[tier]} blocks"
        sizes[tier] -= count
        below = tier + 1
        demoted: list[int] = []
        for victim in victims:
            assert isinstance(victim, int)
            mask = where[victim] & ~(1 << tier)
            if below < num_tiers and not mask >> below & 1 and len(demoted) < caps[below]:
                if demote_cold or victim not in cold:
                    demoted.append(victim)  # the tier below keeps a copy
                    mask |= 1 << below
                else:
                    cold_dropped += 1
            if mask:
                where[victim] = mask
            else:
                del where[victim]
                cold.discard(victim)
                dropped += 1
        if demoted:
            overflow = sizes[below] + len(demoted) - caps[below]
            if overflow > 0:
                make_room(below, overflow, None)
            demoted.reverse()
            policies[below].insert(demoted, [parent_of(v) for v in demoted])
            sizes[below] += len(demoted)
            writes[below] += len(demoted)

    top, top_blocks = policies[0], tiers[0].capacity_blocks
    lengths = trace.input_lengths if cool_at == COOL_AT[0] else []
    for request, chain in enumerate(chains):
        keys = chain if len(chain) <= top_blocks else chain[:top_blocks]
        num_keys = len(keys)
        length = lengths[request] if lengths else None
        ended_at = num_keys if length is None else min(num_keys, length // block_tokens)  # m
        n = hit_boundary(num_keys, full, sliding, lambda g, i: keys[i] * num_groups + g in where)  # noqa: B023
        hits += n
        #                       0        n-w      n                  L
        # full group g:         [ used by the hit  )[ computed, put   )
        # sliding group g:      [ untouched]
        #                                 [ used   )[ computed, put   )
        starts = [0 if w is None else max(0, n - w) for w in windows]
        lowest = [0] * n  # per hit block, the lowest tier one of its needed group blocks is in
        fetched: dict[int, list[int]] = {}
        for g in range(num_groups):  # 2. fetch, per group in chain order
            for i in range(starts[g], n):
                mask = where[keys[i] * num_groups + g]
                tier = (mask & -mask).bit_length() - 1
                lowest[i] = max(lowest[i], tier)
                if tier:
                    fetched.setdefault(tier, []).append(keys[i] * num_groups + g)
        for i in range(n):
            hits_by_tier[lowest[i]] += 1
        for tier, fetched_keys in fetched.items():
            policies[tier].access(fetched_keys)
            reads[tier] += len(fetched_keys)
        # 3. place every group block the request used or computed in the top tier
        placed = [[keys[i] * num_groups + g for i in range(starts[g], num_keys)] for g in range(num_groups)]
        in_use = frozenset(k for group in placed for k in group)
        cold.difference_update(in_use)
        need = sum(1 for k in in_use if not where.get(k, 0) & 1)
        if sizes[0] + need > caps[0]:
            make_room(0, sizes[0] + need - caps[0], _outside(in_use))
        for g, group_keys in enumerate(placed):
            end = len(group_keys)
            while end > 0:  # segments, tail first
                held = where.get(group_keys[end - 1], 0) & 1
                start = end - 1
                while start > 0 and where.get(group_keys[start - 1], 0) & 1 == held:
                    start -= 1
                segment = group_keys[start:end]
                if held:
                    top.access(segment)
                else:
                    first = starts[g] + start
                    top.insert(segment, [keys[first - 1] * num_groups + g if first else None, *segment[:-1]])
                    for key in segment:
                        where[key] = where.get(key, 0) | 1
                    sizes[0] += len(segment)
                end = start
        # 4. cool each sliding group's held blocks below its window at m, but the hit's window
        for g, w in sliding:
            below_window = [keys[i] * num_groups + g for i in range(max(0, ended_at - w))
                            if not starts[g] <= i < n]
            held_keys = [k for k in below_window if k in where]
            for tier in range(num_tiers):
                in_tier = [k for k in held_keys if where[k] >> tier & 1]
                if in_tier:
                    policies[tier].cool(in_tier)
            cooled += sum(1 for k in held_keys if k not in cold)
            cold.update(held_keys)
        if progress is not None and request & 255 == 255:
            progress(256)
    if progress is not None:
        progress(len(chains) & 255)
    names = [t.name for t in tiers]
    return GroupReplayResult(
        policy, layout.name, tuple(tiers), cold_blocks, layout.group_blocks_per_block, trace.num_requests,
        trace.num_blocks, hits, dict(zip(names, hits_by_tier, strict=True)), dict(zip(names, reads, strict=True)),
        dict(zip(names, writes, strict=True)), dropped, cooled, cold_dropped, time.perf_counter() - started,
    )
