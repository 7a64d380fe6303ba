"""Scheduler: continuous batching under a per-step token budget, chunked prefill, prefix reuse
from every tier, asynchronous loading, and preemption by recompute.

A step's batch is built in this order, each part from what the budget leaves:
  1. decode: every decoding sequence, one token each (oldest first). When the pool has no
     block for one, the newest running sequence is preempted (recompute).
  2. prefill: running sequences with uncomputed tokens get a chunk each.
  3. admission: waiting sequences, first come first served. A sequence's full prompt blocks
     (never the last token's) are hashed and looked up: device hits are shared, and so are
     the blocks this step's chunks compute (prompts arriving together over a new prefix
     compute it once); host and disk hits the fetch policy accepts get fresh device blocks and
     an asynchronous fetch (LOADING), during which the other sequences keep stepping; the
     rest is prefilled.

Preemption frees the victim's blocks: its full blocks keep their keys and stay in the device
prefix cache, and if evicted later they are demoted to the host tier. Readmission looks the
prefix up like any prompt, so a preempted sequence usually reloads, not recomputes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.engine.block_manager import BlockManager
from kvstore.engine.fetcher import Fetcher
from kvstore.engine.group_hits import GroupFetch, admit_groups, cool_below_windows, finish_group_fetch
from kvstore.engine.sequence import SeqStatus, Sequence

KeysFn = Callable[[list[int], str, "bytes | None"], list[bytes]]


@dataclass
class Scheduled:
    """One sequence's part of a step: tokens ``[start, start + num_tokens)`` are computed."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def completes(self) -> bool:
        """The chunk reaches the sequence's last token, whose logits give the next token."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def num_written(self) -> int:
        """Tokens whose K/V the chunk writes: all but those the blocks hold already
        (``Sequence.kv_filled``: the last token of a prompt found whole in the cache)."""
        return self.num_tokens - max(0, min(self.seq.kv_filled, self.start + self.num_tokens) - self.start)


class Scheduler:
    def __init__(self, blocks: BlockManager, fetcher: Fetcher | None, block_keys: KeysFn | None,
                 max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.blocks = blocks
        self.fetcher = fetcher  # None: no lower tiers
        self.block_keys = block_keys  # None: prefix caching off
        self.block_size = blocks.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.loading: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.loading or self.running)

    # ----------------------------------------------------------------------------- one step

    def schedule(self) -> list[Scheduled]:
        self.blocks.end_step()  # the last step's blocks: sealed, or (it failed) never computed
        self._poll_loading()
        budget = self.max_num_batched_tokens
        batch: list[Scheduled] = []
        for seq in [s for s in self.running if s.is_decoding]:
            if budget == 0:
                break
            if seq.status != SeqStatus.RUNNING:
                continue  # preempted to make room for an older sequence
            if not self._make_room(seq, batch):
                continue
            self._append_slot(seq)
            batch.append(Scheduled(seq, seq.num_cached_tokens, 1))
            budget -= 1
        for seq in [s for s in self.running if not s.is_decoding]:
            if budget == 0:
                break
            if seq.status != SeqStatus.RUNNING:
                continue  # preempted to make room for an older sequence's chunk
            budget -= self._schedule_chunk(seq, budget, batch, preempt=True)
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
            if not self._admit(self.waiting[0]):
                break
            seq = self.waiting.popleft()
            if seq.status == SeqStatus.RUNNING:
                budget -= self._schedule_chunk(seq, budget, batch)
        return batch

    def _schedule_chunk(self, seq: Sequence, budget: int, batch: list[Scheduled], preempt: bool = False) -> int:
        """Schedule the next prefill chunk of ``seq`` within ``budget`` and the free blocks.

        With ``preempt``, a chunk that finds no free block preempts the newest running
        sequences not in this step's batch (``seq`` itself last, as decode does): running
        sequences that all wait for a block in mid-prefill would otherwise never move again.
        """
        start = seq.num_cached_tokens
        n = min(seq.num_tokens - start, budget)
        room = (len(seq.block_table) + self.blocks.num_available) * self.block_size - start
        if preempt and n > 0 and room <= 0:
            scheduled = {item.seq.seq_id for item in batch}
            while room <= 0:
                victim = [s for s in self.running if s.seq_id not in scheduled][-1]  # seq is among them
                self._preempt(victim)
                if victim is seq:
                    return 0
                room = (len(seq.block_table) + self.blocks.num_available) * self.block_size - start
        n = min(n, room)
        if n <= 0:
            return 0
        need = -(-(start + n) // self.block_size) - len(seq.block_table)
        if need > 0:
            demoted = self.blocks.demote_s
            seq.block_table += self.blocks.allocate(need)
            seq.request.metrics.stages["demote"] += self.blocks.demote_s - demoted
        batch.append(Scheduled(seq, start, n))
        self._announce(seq, start, n)
        return n

    def _announce(self, seq: Sequence, start: int, n: int) -> None:
        """The full blocks a chunk completes, findable by the sequences admitted after it in the
        same step (``BlockManager.schedule``): concurrent prompts over one new prefix compute it
        once, not once each."""
        first, end = start // self.block_size, (start + n) // self.block_size
        if self.block_keys is None or end <= first or not seq.request.params.writes_prefix_cache:
            return
        keys = self.ensure_keys(seq, end)
        self.blocks.schedule(keys[first:end], seq.block_table[first:end])

    def _needs_block(self, seq: Sequence) -> bool:
        pos = seq.num_cached_tokens
        if pos % self.block_size == 0:
            return True
        return self.blocks.blocks[seq.block_table[-1]].ref_count > 1  # shared partial block: copy

    def _append_slot(self, seq: Sequence) -> None:
        if seq.num_cached_tokens % self.block_size == 0:
            seq.block_table += self.blocks.allocate(1)
        elif self.blocks.blocks[seq.block_table[-1]].ref_count > 1:
            seq.block_table[-1] = self.blocks.copy_on_write(seq.block_table[-1])

    def _make_room(self, seq: Sequence, batch: list[Scheduled]) -> bool:
        """Preempt the newest running sequences until ``seq`` can append; False if ``seq`` itself went."""
        scheduled = {item.seq.seq_id for item in batch}
        while self._needs_block(seq) and self.blocks.num_available == 0:
            victims = [s for s in self.running if s.seq_id not in scheduled]
            victim = victims[-1]  # seq itself is among them, the last resort
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = seq.kv_filled = 0
        seq.status = SeqStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        seq.request.metrics.num_preemptions += 1
        seq.request.first_pass = False
        self.num_preemptions += 1

    # ----------------------------------------------------------------------------- admission

    def ensure_keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained keys of ``seq``'s first ``num_blocks`` full blocks (computed once)."""
        assert self.block_keys is not None
        have = len(seq.block_keys)
        if have < num_blocks:
            bs = self.block_size
            parent = seq.block_keys[-1] if have else None
            seq.block_keys += self.block_keys(seq.token_ids[have * bs : num_blocks * bs],
                                              seq.request.tenant, parent)
        return seq.block_keys[:num_blocks]

    def _admit(self, seq: Sequence) -> bool:
        """Give ``seq`` its cached prefix (device hits now, lower tiers by fetch); False: no room."""
        caching = self.block_keys is not None and seq.request.params.reads_prefix_cache
        stages = seq.request.metrics.stages
        t0 = time.perf_counter()
        keys = self.ensure_keys(seq, seq.num_tokens // self.block_size) if caching else []
        t1 = time.perf_counter()
        stages["hash"] += t1 - t0
        if self.blocks.groups is not None and not self.blocks.groups.trivial:
            admitted = admit_groups(self.blocks, self.fetcher, seq, keys)
            if admitted is None:
                return False
            self._start(seq, admitted if isinstance(admitted, GroupFetch) else None)
            return True
        hits = self.blocks.match(keys)
        rest = keys[len(hits):]
        tiers: tuple[str, ...] = ()
        if rest and self.fetcher is not None:
            found = self.fetcher.store.lookup(rest).tiers
            tiers = tuple(found[: self.fetcher.plan(found)])
            stages["lookup"] += time.perf_counter() - t1
        # room for the hits we revive, the fetched blocks, and one block of computation
        if self.blocks.num_reusable(hits) + len(tiers) + 1 > self.blocks.num_available:
            return False
        self.blocks.acquire(hits)
        seq.block_table = list(hits)
        seq.num_cached_tokens = len(hits) * self.block_size
        if seq.request.first_pass:  # hits of a readmission are its own blocks: no cache hits
            seq.request.metrics.cached_tokens["device"] += seq.num_cached_tokens
        if tiers:
            assert self.fetcher is not None
            demoted = self.blocks.demote_s
            ids = sorted(self.blocks.allocate(len(tiers)))  # fresh blocks: sorted, fewer runs to fetch into
            stages["demote"] += self.blocks.demote_s - demoted
            seq.block_table += ids
            self._start(seq, self.fetcher.start(rest[: len(tiers)], ids, tiers))
        else:
            self._start(seq, None)
        return True

    def _start(self, seq: Sequence, loading: Any) -> None:
        """An admitted sequence: LOADING while ``loading`` (a fetch) is in flight, else RUNNING."""
        if loading is not None:
            seq.loading, seq.status = loading, SeqStatus.LOADING
            self.loading.append(seq)
        else:
            self._whole_hit(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    @staticmethod
    def _whole_hit(seq: Sequence) -> None:
        """A sequence found whole in the cache computes its last token again, for its logits,
        but not that token's K/V: its cached last block holds them (``Sequence.kv_filled``).
        vLLM computes the whole last block again in this case."""
        if seq.num_cached_tokens == seq.num_tokens:
            seq.kv_filled = seq.num_tokens
            seq.num_cached_tokens -= 1

    def _poll_loading(self) -> None:
        for seq in [s for s in self.loading if s.loading.handle.done()]:
            self.finish_loading(seq)

    def finish_loading(self, seq: Sequence) -> None:
        """Complete ``seq``'s fetch: publish the delivered blocks, free the rest, start running."""
        assert self.fetcher is not None
        if isinstance(seq.loading, GroupFetch):
            finish_group_fetch(self.blocks, self.fetcher, seq)
            seq.loading = None
            self._whole_hit(seq)
            seq.status = SeqStatus.RUNNING
            self.loading.remove(seq)
            self.running.append(seq)
            return
        loading = seq.loading
        tiers = self.fetcher.finish(loading)
        n = len(tiers)
        self.blocks.release(loading.block_ids[n:])  # not delivered: recomputed after the hits
        del seq.block_table[len(seq.block_table) - len(loading.block_ids) + n :]
        first = seq.num_cached_tokens // self.block_size
        for j in range(first, first + n) if seq.request.params.writes_prefix_cache else ():
            parent = seq.block_keys[j - 1] if j else None
            self.blocks.seal(seq.block_table[j], seq.block_keys[j], parent, seq.request.tenant,
                             seq.token_ids[j * self.block_size : (j + 1) * self.block_size], computed=False)
        seq.num_cached_tokens += n * self.block_size
        metrics = seq.request.metrics
        if seq.request.first_pass:  # a readmission fetches the request's own blocks back: no cache hits
            for tier in tiers:  # "remote" appears once a remote tier served a block
                metrics.cached_tokens[tier] = metrics.cached_tokens.get(tier, 0) + self.block_size
        metrics.loading_s += max(loading.finished_s[0] - loading.started_s, 0.0) if loading.finished_s else 0.0
        metrics.stages["fetch"] += time.perf_counter() - loading.started_s - loading.copy_s
        metrics.stages["device_copy"] += loading.copy_s
        seq.loading = None
        self._whole_hit(seq)
        seq.status = SeqStatus.RUNNING
        self.loading.remove(seq)
        self.running.append(seq)

    # ----------------------------------------------------------------------------- after a step

    def computed(self, item: Scheduled) -> None:
        """Record that ``item``'s tokens are in the cache; publish blocks that became full."""
        seq = item.seq
        before = seq.num_cached_tokens // self.block_size
        seq.num_cached_tokens = item.start + item.num_tokens
        after = seq.num_cached_tokens // self.block_size
        if self.block_keys is not None and after > before and seq.request.params.writes_prefix_cache:
            keys = self.ensure_keys(seq, after)
            for j in range(before, after):
                self.blocks.seal(seq.block_table[j], keys[j], keys[j - 1] if j else None, seq.request.tenant,
                                 seq.token_ids[j * self.block_size : (j + 1) * self.block_size])

    def fork(self, seq: Sequence, index: int) -> Sequence:
        """A new sample of ``seq``'s request sharing all its blocks (copied on write later)."""
        child = seq.fork(index)
        self.blocks.acquire(child.block_table)
        self.running.append(child)
        return child

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        cool_below_windows(self.blocks, seq)
        self.blocks.release(seq.block_table)
        seq.block_table = []
        self.running.remove(seq)

    def abort(self, seqs: list[Sequence]) -> None:
        """Stop ``seqs`` wherever they are and release their blocks (full blocks stay cached).
        A sequence whose fetch is in flight waits for it first: the fetch writes its blocks."""
        for seq in seqs:
            if seq.status == SeqStatus.LOADING:
                seq.loading.handle.wait()
                self.finish_loading(seq)
            if seq.status == SeqStatus.RUNNING:
                self.finish(seq, "abort")
            elif seq.status == SeqStatus.WAITING:
                assert not seq.block_table, "a waiting sequence holds no blocks"
                self.waiting.remove(seq)
                seq.status = SeqStatus.FINISHED
                seq.finish_reason = "abort"

    def abort_all(self) -> list[Any]:
        """Wait for fetches in flight and release every sequence's blocks (engine shutdown)."""
        for seq in list(self.loading):
            seq.loading.handle.wait()
            self.finish_loading(seq)
        seqs = list(self.running) + list(self.waiting)
        for seq in list(self.running):
            self.finish(seq, "abort")
        self.waiting.clear()
        return seqs
