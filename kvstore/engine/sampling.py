"""SamplingParams and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# torch.Generator.manual_seed takes [-2**63, 2**64); a negative seed means seed mod 2**64.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to generate for one prompt.

    Attributes:
        max_tokens: tokens to generate at most (> 0).
        temperature: 0 is greedy; otherwise logits are divided by it before sampling.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability reaches it.
        top_k: keep the k most likely tokens (0 or -1: all).
        seed: seeds this request's generators, in [SEED_MIN, SEED_MAX]: sample i of n uses
            (seed + i) mod 2**64; None: random.
        n: independent samples of the prompt; they share the prompt's KV blocks.
        stop_token_ids: more tokens that end a sample (the stop token is kept in the output).
        ignore_eos: keep generating past the model's EOS.
        prompt_logits: also return the logits of the prompt rows this request computes (float32
            ``[num_prompt_tokens - start, vocab]`` with ``RequestOutput.prompt_logits_start`` =
            start; row t predicts token start + t + 1). By default such a request reads no cache,
            so start is 0 and every prompt row is there.
        skip_reading_prefix_cache: compute the whole prompt, reading no cached prefix (its blocks
            are still stored for later requests); None (default): True exactly when
            ``prompt_logits`` is. False with ``prompt_logits``: the logits of the rows after the
            cached prefix only (scoring a continuation of a cached context).
        skip_writing_prefix_cache: "do not store": none of this request's blocks is written to
            the store or kept in the device prefix cache past the request (nothing of it is
            sealed under a key: its blocks are freed when it ends, and no KV event names them).
            It still reads the cached prefix other requests stored (unless told otherwise).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    prompt_logits: bool = False
    skip_reading_prefix_cache: bool | None = None
    skip_writing_prefix_cache: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (all) or a positive int, got {self.top_k!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive int, got {self.n!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an int in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        if self.skip_reading_prefix_cache is not None and not isinstance(self.skip_reading_prefix_cache, bool):
            raise ValueError(f"skip_reading_prefix_cache must be a bool or None, got {self.skip_reading_prefix_cache!r}")
        if not isinstance(self.skip_writing_prefix_cache, bool):
            raise ValueError(f"skip_writing_prefix_cache must be a bool, got {self.skip_writing_prefix_cache!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether the request starts from its cached prefix (see ``skip_reading_prefix_cache``)."""
        skip = self.prompt_logits if self.skip_reading_prefix_cache is None else self.skip_reading_prefix_cache
        return not skip

    @property
    def writes_prefix_cache(self) -> bool:
        """Whether the request's blocks are kept (device prefix cache, store) for later ones."""
        return not self.skip_writing_prefix_cache


def make_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """The CPU generator of sample ``index`` of a request (None for greedy or unseeded). The
    seed wraps modulo 2**64, so no ``seed`` SamplingParams accepts overflows for any sample."""
    if params.greedy or params.seed is None:
        return None
    return torch.Generator().manual_seed((params.seed + index) % (1 << 64))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of float32 ``logits`` ``[rows, vocab]``; greedy rows batched together."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_row(logits[i], p, generators[i])
    return tokens


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    # in float64 (a temperature float32 rounds to 0 is not 0 there), shifted so the largest
    # logit is 0 before scaling: a tiny temperature sends the others to -inf (the argmax is
    # sampled), never to inf - inf = nan
    row = row.cpu().double()
    row = (row - row.max()) / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # keep a token while the mass before it is below top_p (the first is always kept)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen))
