"""The measurements of ``kvstore bench quality``: each KV variant (a lossy codec on the host
tier, or a quantized device pool) against raw KV, in engines built for the purpose.

Every variant runs on the user's path: a prefix is computed once (its blocks put into the host
tier: encoded by a tier codec; as the pool's pages, kept exactly, for a pool format), evicted from
the device, and fetched back by the next request (``fetch_policy="always"``). Before each such
request the store's lookup must find the whole context in the host tier (lossy copies for a tier
codec, exact ones otherwise), and after it ``cached_tokens["host"]`` must count all of it;
anything else stops the run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvstore.codecs import get_codec
from kvstore.config import StoreSettings
from kvstore.engine.llm import LLMEngine
from kvstore.engine.sampling import SamplingParams
from kvstore.tools.bench.models import BenchModel

BLOCK = 16
RAW = "none"
POOL = "pool:"  # a variant named "pool:int8" is an engine whose device pool holds int8 pages


@dataclass(frozen=True)
class Variant:
    """How one engine keeps KV: ``name`` is "none" (raw), a lossy codec's name (that codec on the
    host tier) or "pool:FORMAT" (``kv_cache_dtype=FORMAT``, raw tiers)."""

    name: str

    @property
    def pool(self) -> str | None:
        return self.name.removeprefix(POOL) if self.name.startswith(POOL) else None

    @property
    def tier_codec(self) -> str:
        return RAW if self.pool is not None else self.name

    @property
    def lossy_in_host(self) -> bool:
        """Whether the host tier's copies are lossy (a pool's pages are kept exactly)."""
        return get_codec(self.tier_codec).lossy

    def engine_kwargs(self) -> dict[str, object]:
        return {"kv_cache_dtype": self.pool or "auto"}


@dataclass
class Greedy:
    """One codec's greedy continuations over the prompts (``reference``: raw KV's no-cache run)."""

    tokens: list[list[int]]
    host_tokens: list[int]  # prompt tokens the host tier served, per prompt
    host_blocks: int  # the prompts' blocks the store's lookup found in the host tier
    lossy_blocks: int  # how many of those it said were lossy copies
    reference: list[list[int]] | None = None  # raw: the run that read no cache
    gaps: list[list[float]] | None = None  # raw: its top-two logit gap at each position (top_two_gaps)
    # not raw: this variant's choice at each position of raw KV's continuation, given raw's tokens
    # before it (teacher-forced: a near-tie flipped once does not shift every later position)
    forced: list[list[int]] | None = None


@dataclass
class Perplexity:
    """One codec's scores over the same windows; ``kl``/``top1`` are against raw KV."""

    nll: float = 0.0  # summed over the scored tokens
    num_scored: int = 0
    host_tokens: list[int] = field(default_factory=list)  # context tokens the host tier served, per window
    host_blocks: int = 0  # as in Greedy
    lossy_blocks: int = 0
    kl: float = 0.0  # summed KL(raw || this), nats
    top1: int = 0  # positions whose argmax equals raw KV's

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.num_scored)


@dataclass
class NoCacheCheck:
    """Raw KV from the host tier against no cache at all, on the first group of windows."""

    num_scored: int
    ppl_host: float
    ppl_no_cache: float
    max_logit_diff: float


def open_engines(model: BenchModel, variants: Sequence[str], host_bytes: int, pool_bytes: int) -> dict[str, LLMEngine]:
    """One engine per variant (``Variant``), raw first, each with its own store: a codec on its
    host tier, or a quantized device pool. ``pool_bytes`` sizes a float32 pool; a quantized one
    gets the same number of blocks."""
    engines: dict[str, LLMEngine] = {}
    for name in (RAW, *variants):
        v = Variant(name)
        engines[name] = model.engine(dtype=torch.float32, block_size=BLOCK, kv_cache_bytes=pool_bytes,
                                     fetch_policy="always", max_num_batched_tokens=4096,
                                     store_settings=StoreSettings(host_bytes=host_bytes, host_codec=v.tier_codec),
                                     **v.engine_kwargs())
    return engines


def forget(llm: LLMEngine, token_lists: Sequence[Sequence[int]]) -> None:
    """Drop these prompts' blocks from the device and the store (the next ones need the room)."""
    assert llm.store is not None
    llm.evict_device_cache()
    for tokens in token_lists:
        llm.store.delete(llm.store.block_keys(list(tokens)))


def check_in_host(llm: LLMEngine, codec: str, contexts: Sequence[Sequence[int]]) -> tuple[int, int]:
    """Every full block of each context is held by the host tier, lossy exactly for a lossy tier
    codec (``codec``: the variant's name); returns how many blocks the lookups found there, and
    how many of them lossy."""
    assert llm.store is not None
    want = Variant(codec).lossy_in_host
    found = lossy = 0
    for i, tokens in enumerate(contexts):
        keys = llm.store.block_keys(list(tokens))
        match = llm.store.lookup(keys)
        if match.tiers != ("host",) * len(keys) or match.lossy != (want,) * len(keys):
            raise RuntimeError(f"{codec}: context {i} ({len(keys)} blocks) should be in the host tier, "
                               f"{'lossy' if want else 'exact'}; the lookup found {match.num_blocks} blocks, "
                               f"tiers {sorted(set(match.tiers))}, lossy {sorted(set(match.lossy))}")
        found += match.count("host")
        lossy += sum(match.lossy)
    return found, lossy


def check_served(codec: str, what: str, served: Sequence[int], expected: Sequence[int]) -> None:
    if list(served) != list(expected):
        raise RuntimeError(f"{codec}: the host tier served {list(served)} tokens of the {what}, expected "
                           f"{list(expected)}")


def measure_greedy(llms: dict[str, LLMEngine], prompts: list[list[int]], num_tokens: int) -> dict[str, Greedy]:
    """Each engine: compute the prompts once (raw: reading no cache, the reference), evict the
    device cache, then decode greedily with the prompts' full blocks fetched from the host tier."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    full = [len(p) // BLOCK * BLOCK for p in prompts]
    results: dict[str, Greedy] = {}
    for codec, llm in llms.items():
        first = llm.generate(prompts, SamplingParams(max_tokens=num_tokens if codec == RAW else 1, temperature=0.0,
                                                     ignore_eos=True, skip_reading_prefix_cache=True))
        llm.evict_device_cache()
        found, lossy = check_in_host(llm, codec, prompts)
        outs = llm.generate(prompts, params)
        host = [o.metrics.cached_tokens["host"] for o in outs]
        check_served(codec, "prompts", host, full)
        results[codec] = result = Greedy([o.token_ids for o in outs], host, found, lossy)
        if codec == RAW:
            result.reference = [o.token_ids for o in first]
            result.gaps = top_two_gaps(llm, prompts, result.tokens)
        forget(llm, [p + o.token_ids for runs in (first, outs) for p, o in zip(prompts, runs, strict=True)])
        if codec != RAW:
            result.forced = teacher_forced(llm, codec, prompts, results[RAW].tokens)
    return results


def teacher_forced(llm: LLMEngine, codec: str, prompts: list[list[int]], raw: list[list[int]]) -> list[list[int]]:
    """This engine's argmax at each position of raw KV's continuations, given raw's tokens before
    it: each prompt's full blocks put and fetched back from the host tier (as in the greedy run),
    then prompt + raw's continuation scored in one request from the rows after that prefix (which
    ends before the prompt's last token)."""
    assert llm.store is not None
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                         skip_reading_prefix_cache=True))
    llm.evict_device_cache()
    # the cached prefix must end before each prompt's last token, whose row predicts the first
    # continuation token: a prompt of whole blocks gives up its last block
    starts = [(len(p) - 1) // BLOCK * BLOCK for p in prompts]
    for prompt, start in zip(prompts, starts, strict=True):
        llm.store.delete(llm.store.block_keys(prompt)[start // BLOCK :])
    check_in_host(llm, codec, [p[:start] for p, start in zip(prompts, starts, strict=True)])
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logits=True, skip_reading_prefix_cache=False)
    outs = llm.generate([p + t[:-1] for p, t in zip(prompts, raw, strict=True)], score)
    picks: list[list[int]] = []
    for prompt, tokens, out, start in zip(prompts, raw, outs, starts, strict=True):
        assert out.prompt_logits is not None and out.prompt_logits_start == start, (out.prompt_logits_start, start)
        # row r predicts token start + r + 1; continuation token j is token len(prompt) + j
        rows = out.prompt_logits[len(prompt) - 1 - start : len(prompt) - 1 - start + len(tokens)]
        picks.append(rows.argmax(dim=-1).tolist())
    forget(llm, [p + t for p, t in zip(prompts, raw, strict=True)])
    return picks


def top_two_gaps(llm: LLMEngine, prompts: list[list[int]], continuations: list[list[int]],
                 batch: int = 5) -> list[list[float]]:
    """The gap between the two highest logits at each position of each continuation (no cache;
    a gap near 0 is a near-tie, which any error in the KV may flip)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logits=True)
    gaps: list[list[float]] = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        outs = llm.generate([p + t[:-1] for p, t in zip(chunk, continuations[i : i + batch], strict=True)], params)
        for prompt, out in zip(chunk, outs, strict=True):
            assert out.prompt_logits is not None and out.prompt_logits_start == 0
            top = out.prompt_logits[len(prompt) - 1 :].topk(2, dim=-1).values  # row j: continuation token j
            gaps.append((top[:, 0] - top[:, 1]).tolist())
    return gaps


def agreement(ours: list[list[int]], raw: list[list[int]]) -> tuple[float, int, list[tuple[int, int]]]:
    """% of positions equal to raw's, continuations identical in full, and for the others
    (prompt index, first divergence: the position in the continuation, from 1)."""
    equal = sum(a == b for x, y in zip(ours, raw, strict=True) for a, b in zip(x, y, strict=True))
    total = sum(len(y) for y in raw)
    firsts = [(n, next(i + 1 for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b))
              for n, (x, y) in enumerate(zip(ours, raw, strict=True)) if x != y]
    return 100.0 * equal / total, len(raw) - len(firsts), firsts


def measure_perplexity(llms: dict[str, LLMEngine], tokens: list[int], context: int, scored: int, group: int,
                       progress: Callable[[str], None] = print) -> tuple[dict[str, Perplexity], NoCacheCheck]:
    """Window i is ``tokens[i * scored : i * scored + context + scored + 1]``: its first
    ``context`` tokens are put, evicted to the host tier and fetched back through the codec;
    its next ``scored`` tokens are scored, so each token after the first ``context + 1`` is
    scored once. Windows run ``group`` at a time in each engine, raw first."""
    assert context % BLOCK == 0 and (len(tokens) - context - 1) % scored == 0
    num_windows = (len(tokens) - context - 1) // scored
    windows = [tokens[i * scored : i * scored + context + scored + 1] for i in range(num_windows)]
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logits=True, skip_reading_prefix_cache=False)
    results = {codec: Perplexity() for codec in llms}
    check: NoCacheCheck | None = None
    start = time.perf_counter()
    for first in range(0, num_windows, group):
        batch = windows[first : first + group]
        contexts = [w[:context] for w in batch]
        raw_logits: list[torch.Tensor] = []  # raw KV's rows of each window, while the codecs score it
        for codec, llm in llms.items():
            llm.generate(contexts, SamplingParams(max_tokens=1, temperature=0.0))
            llm.evict_device_cache()
            found, lossy = check_in_host(llm, codec, contexts)
            outs = llm.generate(batch, score)
            host = [o.metrics.cached_tokens["host"] for o in outs]
            check_served(codec, "contexts", host, [context] * len(batch))
            r = results[codec]
            r.host_tokens += host
            r.host_blocks += found
            r.lossy_blocks += lossy
            for j, (out, window) in enumerate(zip(outs, batch, strict=True)):
                assert out.prompt_logits is not None and out.prompt_logits_start == context
                logits = out.prompt_logits[:scored]  # row t predicts token context + t + 1
                nll, kl, top1 = score_rows(logits, window[context + 1 :], None if codec == RAW else raw_logits[j])
                r.nll += nll
                r.kl += kl
                r.top1 += top1
                r.num_scored += scored
                if codec == RAW:
                    raw_logits.append(logits)
            if codec == RAW and check is None:
                check = no_cache_check(llm, batch, raw_logits, context)
            del outs  # the next engine's logits take their place
            forget(llm, batch)
        done = min(first + group, num_windows)
        progress(f"  perplexity: {done}/{num_windows} windows, {time.perf_counter() - start:.0f} s")
    assert check is not None
    return results, check


def score_rows(logits: torch.Tensor, targets: list[int], raw: torch.Tensor | None,
               rows: int = 64) -> tuple[float, float, int]:
    """The summed negative log-likelihood of ``targets`` (row t predicts targets[t]) and, against
    ``raw`` (raw KV's logits of the same rows), the summed KL(raw || logits) and the rows whose
    argmax agrees. In float64, ``rows`` rows at a time (a row of SmolLM2 is 49,152 logits)."""
    target = torch.tensor(targets)
    nll = kl = 0.0
    top1 = 0
    for i in range(0, len(targets), rows):
        logp = torch.log_softmax(logits[i : i + rows].double(), dim=-1)
        nll -= float(logp.gather(1, target[i : i + rows, None]).sum())
        if raw is not None:
            raw_logp = torch.log_softmax(raw[i : i + rows].double(), dim=-1)
            kl += float((raw_logp.exp() * (raw_logp - logp)).sum())
            top1 += int((raw_logp.argmax(-1) == logp.argmax(-1)).sum())
    return nll, kl, top1


def no_cache_check(llm: LLMEngine, batch: list[list[int]], host_logits: list[torch.Tensor],
                   context: int) -> NoCacheCheck:
    """The same windows with nothing cached: what the host tier's exact copy should reproduce."""
    fresh = llm.generate(batch, SamplingParams(max_tokens=1, temperature=0.0, prompt_logits=True))
    nll_host = nll_fresh = diff = 0.0
    num_scored = 0
    for window, logits, new in zip(batch, host_logits, fresh, strict=True):
        assert new.prompt_logits is not None and new.prompt_logits_start == 0
        new_logits = new.prompt_logits[context : context + len(logits)]
        targets = window[context + 1 :]
        nll_host += score_rows(logits, targets, None)[0]
        nll_fresh += score_rows(new_logits, targets, None)[0]
        diff = max(diff, float((logits - new_logits).abs().max()))
        num_scored += len(targets)
    return NoCacheCheck(num_scored, math.exp(nll_host / num_scored), math.exp(nll_fresh / num_scored), diff)


def room_blocks(prompts: list[list[int]], num_tokens: int, window_tokens: int, group: int) -> int:
    """Blocks a store (and a device pool) needs: the greedy phase's prompts with two continuations
    each (the raw engine stores its no-cache run's and its cached run's), or a group of windows;
    a quarter more, since a block whose put lands after ``forget`` stays until it is evicted."""
    greedy = sum(len(p) // BLOCK + 2 * -(-num_tokens // BLOCK) + 1 for p in prompts)
    return max(greedy, group * -(-window_tokens // BLOCK)) * 5 // 4


