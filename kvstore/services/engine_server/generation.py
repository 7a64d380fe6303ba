"""One engine request as the server sees it: each sample's text so far, stop strings, the
deltas to stream, and the usage to report.

Text is decoded from a sample's whole output each time (a tokenizer may merge tokens), and
handed out as deltas. Two things are held back until more tokens or the end arrive: a trailing
U+FFFD (an incomplete UTF-8 sequence may still complete) and the last ``len(stop) - 1``
characters (they may begin a stop string). A stop string ends its sample; the text stops
before it, as OpenAI's API does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.engine.sequence import RequestOutput
from kvstore.services.engine_server.tokenizer import ServeTokenizer

TIERS = ("device", "host", "disk", "remote")


@dataclass
class Delta:
    """New text of choice ``index``; ``finish_reason`` set on its last delta."""

    index: int
    text: str
    finish_reason: str | None = None


@dataclass
class Sample:
    index: int
    emitted: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    last_token_s: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Generation:
    """The samples of one prompt; choice indices start at ``first_index``."""

    request_id: str
    prompt_token_ids: list[int]
    n: int
    stops: list[str]
    tokenizer: ServeTokenizer
    first_index: int = 0
    samples: list[Sample] = field(default_factory=list)
    cached_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    num_computed_tokens: int = 0
    num_recomputed_tokens: int = 0
    closed: bool = False  # the engine request ended (finished, or aborted by the server)
    arrival_s: float = 0.0
    ttft_s: float | None = None
    gaps: list[float] = field(default_factory=list)  # inter-token latencies not yet reported
    stopped: list[int] = field(default_factory=list)  # samples a stop string ended, the engine not yet

    def __post_init__(self) -> None:
        self.samples = [Sample(self.first_index + i) for i in range(self.n)]

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    def update(self, out: RequestOutput, now: float) -> list[Delta]:
        """Take the engine's latest output of this request (at ``now``, perf_counter); the deltas."""
        deltas = []
        for completion in out.outputs:
            sample = self.samples[completion.index]
            if sample.done:
                continue  # stopped by a stop string; the engine's later tokens are dropped
            new_tokens = len(completion.token_ids) - sample.num_tokens
            if new_tokens > 0:
                if self.ttft_s is None:
                    self.ttft_s = now - self.arrival_s
                if sample.last_token_s is not None:
                    self.gaps += [(now - sample.last_token_s) / new_tokens] * new_tokens
                sample.last_token_s = now
            sample.num_tokens = len(completion.token_ids)
            text = self.tokenizer.decode(completion.token_ids)
            finish = completion.finish_reason
            cut = self._find_stop(text, len(sample.emitted))
            if cut is not None:
                if finish is None:
                    self.stopped.append(completion.index)
                text, finish = text[:cut], "stop"
            if finish is None:
                text = text[: self._safe_length(text)]
            if len(text) > len(sample.emitted) or finish is not None:
                new = text[len(sample.emitted):]
                sample.emitted = text if len(text) > len(sample.emitted) else sample.emitted
                sample.finish_reason = finish
                deltas.append(Delta(sample.index, new, finish))
        if out.finished or self.done:
            self.closed = self.closed or out.finished
            self.cached_tokens.update(out.metrics.cached_tokens)
            self.num_computed_tokens = out.metrics.num_computed_tokens
            self.num_recomputed_tokens = out.metrics.num_recomputed_tokens
        return deltas

    def _find_stop(self, text: str, emitted: int) -> int | None:
        """The earliest stop string's start in ``text`` past what was already handed out."""
        starts = [i for i in (text.find(s, max(0, emitted - len(s) + 1)) for s in self.stops) if i >= 0]
        return min(starts) if starts else None

    def _safe_length(self, text: str) -> int:
        """How much of a running sample's text can go out now (see the module docstring)."""
        n = len(text)
        while n and text[n - 1] == "\ufffd":
            n -= 1
        hold = max((len(s) for s in self.stops), default=1) - 1
        return max(0, min(n, len(text) - hold))

    @property
    def num_cached_tokens(self) -> int:
        return sum(self.cached_tokens.values())
