"""A request, its sequences (one per sample), their states, metrics and outputs."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.engine.sampling import SamplingParams, make_generator


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and queued again
    LOADING = "loading"  # lower-tier prefix blocks are being fetched into its device blocks
    RUNNING = "running"  # prefilling the uncached suffix (in chunks), then decoding
    FINISHED = "finished"


STAGES = ("hash", "lookup", "demote", "fetch", "device_copy", "prefill", "schedule")


@dataclass
class RequestMetrics:
    """Per request. Each prompt token counts once: in ``cached_tokens`` under the tier that
    served it at the request's first admission, or in ``num_computed_tokens`` (prefilled; a
    block a fetch failed to deliver is computed), so the two sum to the prompt once it is
    prefilled. ``num_recomputed_tokens`` counts the rest of the prefill work: tokens (prompt or
    generated) computed again after one of the request's sequences was preempted.

    ``stages`` splits the time to the first token (seconds, summing to ``ttft_s``): ``hash``
    the prompt's block keys, ``lookup`` the store's prefix lookup, ``demote`` evicting device
    blocks to make room (only the gathers: the puts run on the demoter thread), ``fetch`` from
    the fetch's start until the engine saw it done, ``device_copy`` a staged fetch's scatter
    into the pool, ``prefill`` the model steps that computed its uncached tokens (and sampled
    the first), ``schedule`` the rest: queueing and the engine loop.
    """

    arrival_s: float = field(default_factory=time.perf_counter)
    ttft_s: float | None = None
    latency_s: float | None = None
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_recomputed_tokens: int = 0
    num_generated_tokens: int = 0
    cached_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    loading_s: float = 0.0
    num_preemptions: int = 0
    stages: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))

    def count_prefill(self, num_tokens: int) -> None:
        """``num_tokens`` were prefilled: prompt tokens not yet cached or computed, then recompute."""
        fresh = min(num_tokens, max(0, self.num_prompt_tokens - sum(self.cached_tokens.values())
                                    - self.num_computed_tokens))
        self.num_computed_tokens += fresh
        self.num_recomputed_tokens += num_tokens - fresh


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop" (EOS or a stop token), "length", or None while running


@dataclass
class RequestOutput:
    """What ``generate``/``step`` return per request; ``token_ids``/``text`` are sample 0's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logits: torch.Tensor | None = None
    prompt_logits_start: int = 0  # the prompt position of prompt_logits' first row

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text


_seq_ids = itertools.count()


class Sequence:
    """One sample's token ids and its place in the KV pool.

    ``num_cached_tokens`` tokens have their K/V in the blocks of ``block_table``; the tokens after
    them are computed by the next steps. ``block_keys[j]`` is the chained key of full block j.

    ``kv_filled`` tokens have their K/V in the blocks, which is more than ``num_cached_tokens``
    only for a prompt found whole in the cache (its length a multiple of the block size): its
    last token still runs through the model for its logits, but its K/V, which its cached last
    block already holds, are not written again.
    """

    def __init__(self, request: Request, token_ids: list[int], index: int = 0) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids = list(token_ids)
        self.status = SeqStatus.WAITING
        self.block_table: list[int] = []
        self.block_keys: list[bytes] = []
        self.num_cached_tokens = 0
        self.kv_filled = 0
        self.finish_reason: str | None = None
        self.generator = request.generators[index]
        self.loading: Any = None  # the fetch in flight while LOADING
        self.hit_blocks = 0  # the boundary its prefix hit ended at (a hybrid model's windows there were used)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def is_decoding(self) -> bool:
        """Every token but the last sampled one is in the cache: the next step is one token."""
        return self.num_cached_tokens == self.num_tokens - 1 and self.num_output_tokens > 0

    def fork(self, index: int) -> Sequence:
        """A sample sharing this one's tokens and blocks (the caller adds the block references)."""
        child = Sequence(self.request, self.token_ids, index)
        child.status = self.status
        child.block_table = list(self.block_table)
        child.block_keys = list(self.block_keys)
        child.num_cached_tokens = self.num_cached_tokens
        child.kv_filled = self.kv_filled
        child.hit_blocks = self.hit_blocks
        return child


class Request:
    """One prompt with its sampling parameters, tenant, and its ``n`` sequences."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tenant: str) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.tenant = tenant
        self.metrics = RequestMetrics(num_prompt_tokens=len(prompt_token_ids))
        # every sample's generator is made here, when the request is added, not when step()
        # forks the samples: a bad seed fails this request alone
        self.generators = [make_generator(params, i) for i in range(params.n)]
        self.seqs = [Sequence(self, prompt_token_ids)]
        self.forked = params.n == 1
        # until a sequence of it is preempted: admission then counts the prompt's cache hits
        # (later admissions find its own blocks again, which are no cache hits)
        self.first_pass = True
        self.prompt_logit_chunks: list[torch.Tensor] = []
        self.prompt_logits_start = 0

    @property
    def finished(self) -> bool:
        return self.forked and all(s.status == SeqStatus.FINISHED for s in self.seqs)

    def output(self, tokenizer: Any) -> RequestOutput:
        outs = []
        for s in sorted(self.seqs, key=lambda s: s.index):
            ids = s.token_ids[self.num_prompt_tokens :]
            text = tokenizer.decode(ids) if tokenizer is not None else None
            outs.append(CompletionOutput(s.index, ids, text, s.finish_reason))
        logits = torch.cat(self.prompt_logit_chunks) if self.prompt_logit_chunks else None
        return RequestOutput(self.request_id, self.prompt_token_ids, outs, self.finished, self.metrics, logits,
                             self.prompt_logits_start)
