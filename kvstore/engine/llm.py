"""LLMEngine: the public entry point. generate() for batches, add_request()/step() for streaming.

The engine owns the device tier (the KV pool and its prefix cache); the store below it (any
``kvstore.api.BlockStore``: an embedded TieredStore, or a daemon connection) holds the host,
disk and remote tiers.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from kvstore.api import BlockStore, KeyChain
from kvstore.client.client import connect
from kvstore.engine.block_manager import BlockManager
from kvstore.engine.checkpoint import load_checkpoint, random_checkpoint
from kvstore.engine.checkpoint.types import FULL as FULL_ATTENTION
from kvstore.engine.config import EngineConfig, pool_format
from kvstore.engine.device_events import DeviceEvents
from kvstore.engine.fetcher import Fetcher
from kvstore.engine.groups import DeviceGroups
from kvstore.engine.model import LlamaModel
from kvstore.engine.runner import ModelRunner
from kvstore.engine.sampling import SamplingParams
from kvstore.engine.scheduler import Scheduler
from kvstore.engine.sequence import Request, RequestOutput, SeqStatus
from kvstore.errors import ConfigError
from kvstore.events import GPU, EventPublisher, EventsConfig
from kvstore.events.store_events import StoreEvents
from kvstore.kernels import packed_head_dim
from kvstore.keys import BlockHasher, Namespace
from kvstore.layout import DTYPE_NAMES, FULL, SLIDING, KVLayout, group_layers
from kvstore.store import TieredStore
from kvstore.tiers.device import DevicePool

Prompt = str | list[int]


class LLMEngine:
    """A paged-attention engine for Llama-family models over kvstore's tiers.

    Args:
        model: a local Hugging Face checkpoint directory or a .gguf file, or None for a seeded
            random model.
        config: a full EngineConfig instead of keyword arguments.
        **kwargs: EngineConfig fields (device, dtype, kv_cache_bytes, host_bytes, disk_path,
            disk_bytes, fetch_policy, store, block_size, ...).

    Raises:
        CheckpointError: the model directory is missing or malformed.
        ConfigError: an invalid setting, or a KV pool smaller than one block.
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = c = config or EngineConfig.build(model, **kwargs)
        ckpt = random_checkpoint(c.random_model, c.seed) if c.model is None else load_checkpoint(c.model)
        self.model_config = mc = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.device = torch.device(c.device)
        self.model = LlamaModel(mc, ckpt.weights, self.device, c.dtype, prepack=c.prepack_weights)
        self.max_model_len = c.max_model_len or mc.max_position_embeddings
        # the pool's blocks, as the store keeps them: values, or quantized pages (codes + scales)
        pool_dtype, self.kv_codes = pool_format(c)
        # what the pool holds, by name: "float32", "float16", "bfloat16", "int8" or "fp8"
        self.kv_cache_dtype = c.kv_cache_dtype if c.kv_cache_dtype != "auto" else DTYPE_NAMES[c.dtype]
        head_bytes = mc.head_dim if self.kv_codes is None else packed_head_dim(mc.head_dim)
        # The device pool keeps every layer of a token block in one block; the store keeps a
        # hybrid model's blocks per KV group (kvstore/engine/groups.py): ``layout`` is the
        # store's (the device's too for a model whose layers all attend fully).
        self.pool_layout = KVLayout(mc.num_layers, mc.num_kv_heads, head_bytes, c.block_size, pool_dtype)
        if c.hybrid_kv:
            slots, kv_groups = group_layers([(FULL, None) if spec.kind == FULL_ATTENTION else (SLIDING, spec.window)
                                             for spec in mc.layer_specs])
            self.layout = KVLayout(slots, mc.num_kv_heads, head_bytes, c.block_size, pool_dtype, groups=kv_groups)
        else:
            self.layout = self.pool_layout
        self.groups = DeviceGroups(self.layout, mc.num_layers)
        num_blocks = c.kv_cache_bytes // self.pool_layout.bytes_per_block
        if num_blocks < 1:
            raise ConfigError(f"kv_cache_bytes={c.kv_cache_bytes} holds no block of "
                              f"{self.pool_layout.bytes_per_block} bytes")
        self.pool = DevicePool(num_blocks, self.pool_layout.block_shape, pool_dtype, self.device)
        # A sequence never holds more tokens than the whole pool: one that reaches it stops
        # with "length", as at the context limit (growing further could only preempt itself).
        self._max_seq_tokens = min(self.max_model_len, num_blocks * c.block_size)
        self.model_id = c.model_id or ckpt.model_id
        if self.kv_codes is not None:  # int8 and fp8 pages share a byte layout: the namespace tells them apart
            self.model_id += f"+kv-{c.kv_cache_dtype}"
        self.store, self._owns_store = self._open_store()
        # the namespace the keys hash in (a router computes the same keys from it)
        self.namespace: Namespace = (self.store.namespace if self.store is not None
                                     else Namespace(self.model_id, self.layout))
        self.kv_events: EventPublisher | None = None
        self._store_events: StoreEvents | None = None
        device_events = None
        if c.kv_events is not None:
            self.kv_events = EventPublisher(EventsConfig(c.kv_events, c.kv_events_replay))
            device_events = DeviceEvents(self.kv_events, self.layout, BlockHasher(self.namespace).group_keys)
        self.block_manager = BlockManager(self.pool, c.block_size, self.store, events=device_events,
                                          write_through=c.device_write_policy == "write_through",
                                          groups=None if self.groups.trivial else self.groups)
        if self.kv_events is not None and device_events is not None:
            self.kv_events.set_media(GPU, {"kv_cache_dtype": self.kv_cache_dtype,
                                           "block_bytes": self.pool_layout.bytes_per_block})
            held = device_events.held
            self.kv_events.add_source(lambda: [(GPU, c.block_size, held(self.block_manager.held_blocks()))])
            if isinstance(self.store, TieredStore):  # embedded (a daemon publishes its own tiers' events)
                self._store_events = StoreEvents(self.kv_events, self.store).attach()
        fetcher = Fetcher(self.store, self.pool.pool, c.fetch_policy, c.block_size) if self.store is not None else None
        self.fetcher = fetcher
        keys_fn = None
        if c.enable_prefix_caching:
            hasher: KeyChain = self.store if self.store is not None else BlockHasher(self.namespace)
            keys_fn = lambda tokens, tenant, parent: hasher.block_keys(tokens, tenant, parent=parent)  # noqa: E731
        self.scheduler = Scheduler(self.block_manager, fetcher if c.enable_prefix_caching else None, keys_fn,
                                   c.max_num_batched_tokens, c.max_num_seqs)
        self.runner = ModelRunner(self.model, self.pool.pool, c.block_size, self.kv_codes,
                                  cpu_decode_kernel=c.cpu_decode_kernel)  # builds the kernel now, if used
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._closed = False

    def _open_store(self) -> tuple[BlockStore | None, bool]:
        c = self.config
        if c.store_url is not None:
            store: BlockStore = connect(c.store_url, c.store_token, layout=self.layout, model_id=self.model_id)
            owned = True
        elif c.store is not None:
            store, owned = c.store, False
        elif c.store_settings.host_bytes:
            pages = c.kv_cache_dtype if self.kv_codes is not None else "none"
            store = TieredStore(c.store_settings.store_config(self.layout, self.model_id, pages=pages))
            owned = True
        else:
            return None, False
        if store.layout != self.layout:
            raise ConfigError(f"the store's layout {store.layout.fingerprint()} differs from the model's "
                              f"{self.layout.fingerprint()}")
        return store, owned

    # ----------------------------------------------------------------------------- requests

    def _tokens(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (tokenizer.json in the model directory); "
                                 "pass token ids instead")
            ids = list(self.tokenizer.encode(prompt).ids)
        elif isinstance(prompt, list | tuple):
            ids = list(prompt)
        else:
            raise ValueError(f"a prompt is a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{len(bad)} prompt token ids outside [0, {vocab}), first {bad[0]!r}")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {self.max_model_len}")
        blocks = -(-(len(ids) + 1) // self.config.block_size)
        if blocks > self.pool.num_blocks:
            raise ValueError(f"the prompt needs {blocks} KV blocks; the device pool has {self.pool.num_blocks} "
                             "(raise kv_cache_bytes)")
        return ids

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, tenant: str = "",
                    request_id: str | None = None) -> str:
        """Queue one prompt; returns its request id. Raises ValueError (and queues nothing) for
        bad input: an empty prompt, ids outside the vocabulary, a prompt over the context."""
        self._check_open()
        if not isinstance(tenant, str):
            raise ValueError(f"tenant must be a str, got {type(tenant).__name__}")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self._tokens(prompt)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, ids, params, tenant)
        self._requests[request_id] = request
        self.scheduler.add(request.seqs[0])
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks (its full blocks stay in the device prefix cache).
        Returns False (and changes nothing) for an unknown or already finished request id."""
        self._check_open()
        request = self._requests.pop(str(request_id), None)
        if request is None:
            return False
        self.scheduler.abort(request.seqs)
        request.forked = True
        request.metrics.latency_s = time.perf_counter() - request.metrics.arrival_s
        return True

    def abort_sample(self, request_id: str, index: int) -> bool:
        """Stop sample ``index`` of a request (a server's stop string ended it) and free its
        blocks; the other samples go on. Returns False (and changes nothing) for an unknown
        request or sample, one already finished, or a request whose samples have not started
        (n > 1 before its prefill ends: abort the request instead)."""
        self._check_open()
        request = self._requests.get(str(request_id))
        if request is None or not request.forked:
            return False
        seq = next((s for s in request.seqs if s.index == index), None)
        if seq is None or seq.status == SeqStatus.FINISHED:
            return False
        self.scheduler.abort([seq])
        if request.finished:  # its other samples had finished: nothing of it is left to step
            del self._requests[request.request_id]
            request.metrics.latency_s = time.perf_counter() - request.metrics.arrival_s
        return True

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        """The token ids ``add_request`` would queue for ``prompt``, queuing nothing. Reads only
        settings fixed at construction, so any thread may call it. Raises ValueError as add_request."""
        return self._tokens(prompt)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the requests that progressed (finished ones last seen)."""
        self._check_open()
        items = self.scheduler.schedule()
        if not items:
            if self.scheduler.loading:  # nothing to compute: wait a little for a fetch
                self.scheduler.loading[0].loading.handle.wait(0.005)
            return []
        prefill = [it for it in items if not it.seq.is_decoding]
        t0 = time.perf_counter()
        done, logits = self.runner.run(items)
        if self.fetcher is not None:
            self.fetcher.record_prefill(sum(it.num_tokens for it in prefill), time.perf_counter() - t0)
        for it in prefill:
            it.seq.request.metrics.count_prefill(it.num_written)
        for it in items:
            self.scheduler.computed(it)
        self.block_manager.write_sealed()
        seqs, rows = [], []
        for k, it in enumerate(done):
            seqs.append(it.seq)
            rows.append(k)
            request = it.seq.request
            if not request.forked:  # n > 1: the samples share the prompt's blocks from here
                for i in range(1, request.params.n):
                    child = self.scheduler.fork(it.seq, i)
                    request.seqs.append(child)
                    seqs.append(child)
                    rows.append(k)
                request.forked = True
        if len(rows) != logits.shape[0]:  # n > 1 forks repeat rows; otherwise rows is 0..k-1
            logits = logits[rows]
        tokens = self.runner.sample(logits, seqs) if seqs else []
        now = time.perf_counter()
        for it in prefill:  # the step's wall time, for each request still before its first token
            if it.seq.request.metrics.ttft_s is None:
                it.seq.request.metrics.stages["prefill"] += now - t0
        touched: dict[str, Request] = {}
        for seq, token in zip(seqs, tokens, strict=True):
            request = seq.request
            seq.token_ids.append(token)
            m = request.metrics
            m.num_generated_tokens += 1
            if m.ttft_s is None:
                m.ttft_s = now - m.arrival_s
                m.stages["schedule"] = max(0.0, m.ttft_s - sum(v for k, v in m.stages.items() if k != "schedule"))
            reason = self._stop_reason(seq.request.params, token, seq.num_output_tokens, seq.num_tokens)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            touched[request.request_id] = request
        outputs = []
        for request in touched.values():
            if request.finished:
                request.metrics.latency_s = now - request.metrics.arrival_s
                del self._requests[request.request_id]
            outputs.append(request.output(self.tokenizer))
        return outputs

    def _stop_reason(self, p: SamplingParams, token: int, num_output: int, num_tokens: int) -> str | None:
        if (not p.ignore_eos and token in self.model_config.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if num_output >= p.max_tokens or num_tokens >= self._max_seq_tokens:
            return "length"
        return None

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 tenant: str = "") -> list[RequestOutput]:
        """Run prompts to completion; one RequestOutput per prompt, in order.

        Every prompt is validated before any is queued, so bad input raises ValueError and leaves
        the engine as it was. Other requests queued with add_request() progress meanwhile.
        """
        self._check_open()
        batch: list[Prompt]
        if isinstance(prompts, str) or (isinstance(prompts, list | tuple) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            batch = [prompts]  # type: ignore[list-item]
        else:
            batch = list(prompts)  # type: ignore[arg-type]
        plist: list[SamplingParams | None] = (list(params) if isinstance(params, list | tuple)
                                              else [params] * len(batch))  # type: ignore[list-item]
        if len(plist) != len(batch):
            raise ValueError(f"{len(plist)} SamplingParams for {len(batch)} prompts")
        for prompt in batch:
            self._tokens(prompt)
        ids = [self.add_request(p, sp, tenant) for p, sp in zip(batch, plist, strict=True)]
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            for out in self.step():
                if out.finished:
                    results[out.request_id] = out
        return [results[i] for i in ids]

    # ----------------------------------------------------------------------------- tiers

    def evict_device_cache(self) -> int:
        """Push every cached block no request holds from the device to the store (demoted, not
        dropped); returns how many. The demo and tests use it to force lower-tier hits."""
        return self.block_manager.evict_all()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier occupancy and counters: "device" (the pool), then the store's tiers."""
        out: dict[str, dict[str, Any]] = {"device": self.block_manager.stats()}
        if self.store is not None:
            out.update(self.store.stats())
        sched = self.scheduler
        out["engine"] = {"waiting": len(sched.waiting), "loading": len(sched.loading), "running": len(sched.running),
                         "preemptions": sched.num_preemptions}
        if self.fetcher is not None:
            f = self.fetcher
            out["engine"].update(fetched_blocks=f.num_fetched_blocks, failed_fetch_blocks=f.num_failed_blocks,
                                 host_bandwidth=f.bandwidth["host"], disk_bandwidth=f.bandwidth["disk"],
                                 remote_bandwidth=f.bandwidth["remote"],
                                 prefill_tokens_per_s=f.prefill_rate)
        return out

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()
        for seq in self.scheduler.running:
            assert seq.status == SeqStatus.RUNNING
            assert len(seq.block_table) * self.config.block_size - seq.num_cached_tokens < 2 * self.config.block_size

    def close(self) -> None:
        """Finish fetches in flight, write the device prefix cache back to the store, and close
        the store if the engine opened it (a new engine on the same disk_path finds the prefixes)."""
        if self._closed:
            return
        self._closed = True
        self.scheduler.abort_all()
        self._requests.clear()
        self.runner.close()
        if self.store is not None:
            try:
                self.block_manager.write_back()
            finally:  # a write-back that failed (a daemon gone) still stops the thread and the connection
                self.block_manager.close()
                if self._owns_store:
                    self.store.close()
        if self._store_events is not None:
            self._store_events.detach()
        if self.kv_events is not None:
            self.kv_events.close()  # ends with AllBlocksCleared: this engine holds nothing now

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")
