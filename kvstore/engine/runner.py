"""ModelRunner: turns a step's scheduled chunks into packed tensors, runs the model, samples.

Rows are packed decode first (chunks of one token, attended with the decode kernel), then the
prefill chunks one sequence after another (the prefill kernel). Only rows whose logits are
needed (a chunk's last row when it reaches its sequence's end, or prompt rows that asked for
``prompt_logits``) go through the LM head. On the CPU a step of one sequence and a few rows
(a decode step of one, a prompt's last partial block over its cached prefix) runs on a worker
whose torch ops use one thread (kvstore/engine/threads.py). On the CPU with a float32 pool,
decode attention reads the pool in place through ``kvstore.kernels.cpu_rows``, built here at
start (``row_kernel``), so that no request ever waits for its build.
"""

from __future__ import annotations

import torch

from kvstore.engine.attention import StepPlan, use_torch_path
from kvstore.engine.model import AttentionBatch, LlamaModel
from kvstore.engine.sampling import sample
from kvstore.engine.scheduler import Scheduled
from kvstore.engine.sequence import Sequence
from kvstore.engine.threads import OneThreadWorker
from kvstore.kernels import cpu_rows

# A CPU step of one sequence and at most this many rows runs on the one-thread worker
# (kvstore/engine/threads.py): its ~40 small ops a layer gain less from a second thread than OpenMP's
# fork and join cost. Steps of several sequences keep the caller's threads (their attention
# splits over the sequences: a decode step of 16 took 32 ms on two threads, 49 on one).
ONE_THREAD_ROWS = 16


def _table(seqs: list[Sequence]) -> torch.Tensor:
    width = max((len(s.block_table) for s in seqs), default=0)
    return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                        dtype=torch.int32).reshape(len(seqs), width)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_pool: torch.Tensor, block_size: int,
                 kv_codes: torch.dtype | None = None, cpu_decode_kernel: bool = True) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.kv_codes = kv_codes  # quantized pages' code dtype (kvstore/kernels/pages.py), or None
        self.block_size = block_size
        self.device = kv_pool.device
        # a layer's K view strides blocks by kv_pool.stride(0) and token rows by stride(3)
        self.rows_per_block = kv_pool.stride(0) // kv_pool.stride(3)
        # Over MKL's products, steps of one short sequence (ONE_THREAD_ROWS) run on a thread whose
        # torch ops use one thread. oneDNN's prepacked products use every thread well even at one
        # row: with them, such steps ran 1.14x faster on two threads than on one (docs/engine.md).
        # decode attention over the pool's rows in place (a float32 pool on the torch path)
        self.row_kernel = (cpu_decode_kernel and use_torch_path(self.device) and self.device.type == "cpu"
                           and kv_codes is None and kv_pool.dtype == torch.float32 == model.dtype
                           and cpu_rows.load() is not None)
        self._one_thread = (OneThreadWorker() if self.device.type == "cpu" and torch.get_num_threads() > 1
                            and not model.prepacked else None)

    def prepare(self, items: list[Scheduled]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, int]:
        bs = self.block_size
        decodes = [it for it in items if it.num_tokens == 1]
        prefills = [it for it in items if it.num_tokens > 1]
        ids: list[int] = []
        pos_parts: list[torch.Tensor] = []
        slot_parts: list[torch.Tensor] = []
        if decodes:
            dec_pos = [it.start for it in decodes]
            ids += [it.seq.token_ids[it.start] for it in decodes]
            pos_parts.append(torch.tensor(dec_pos, dtype=torch.long))
            # -1: a token whose K/V its block already holds (Sequence.kv_filled) is not written
            slot_parts.append(torch.tensor([it.seq.block_table[p // bs] * bs + p % bs if p >= it.seq.kv_filled else -1
                                            for it, p in zip(decodes, dec_pos, strict=True)], dtype=torch.long))
        cu = [0]
        for it in prefills:
            ids += it.seq.token_ids[it.start : it.start + it.num_tokens]
            pos = torch.arange(it.start, it.start + it.num_tokens)
            table = torch.tensor(it.seq.block_table, dtype=torch.long)
            pos_parts.append(pos)
            slot_parts.append((table[pos // bs] * bs + pos % bs).masked_fill_(pos < it.seq.kv_filled, -1))
            cu.append(cu[-1] + it.num_tokens)
        dev = self.device
        positions = torch.cat(pos_parts)
        batch = AttentionBatch(
            slot_mapping=torch.cat(slot_parts).to(dev),
            num_decode=len(decodes),
            decode_block_tables=_table([it.seq for it in decodes]).to(dev),
            decode_seq_lens=torch.tensor([it.start + 1 for it in decodes], dtype=torch.int32).to(dev),
            prefill_block_tables=_table([it.seq for it in prefills]).to(dev),
            prefill_seq_lens=torch.tensor([it.start + it.num_tokens for it in prefills], dtype=torch.int32).to(dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32).to(dev),
            max_query_len=max((it.num_tokens for it in prefills), default=0),
        )
        if use_torch_path(dev):
            batch.plan = StepPlan(batch.slot_mapping, [it.seq.block_table for it in decodes],
                                  [it.start + 1 for it in decodes],
                                  [(it.seq.block_table, it.start + it.num_tokens, it.num_tokens) for it in prefills],
                                  bs, self.rows_per_block, dev, row_kernel=self.row_kernel,
                                  windows=self.model.windows)
        max_pos = int(positions.max())
        return torch.tensor(ids, dtype=torch.long).to(dev), positions.to(dev), batch, max_pos

    def run(self, items: list[Scheduled]) -> tuple[list[Scheduled], torch.Tensor]:
        """Run one step; returns the chunks that reached their sequence's end and their logits
        (float32 ``[len(chunks), vocab]``). Prompt logits asked for are kept on the request."""
        items = [it for it in items if it.num_tokens == 1] + [it for it in items if it.num_tokens > 1]
        input_ids, positions, batch, max_pos = self.prepare(items)
        if self._one_thread is not None and len(items) == 1 and input_ids.shape[0] <= ONE_THREAD_ROWS:
            return self._one_thread.call(self._run, items, input_ids, positions, batch, max_pos)
        return self._run(items, input_ids, positions, batch, max_pos)

    def _run(self, items: list[Scheduled], input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
             max_pos: int) -> tuple[list[Scheduled], torch.Tensor]:
        hidden = self.model.forward(input_ids, positions, batch, self.kv_pool, max_pos, self.kv_codes)
        rows: list[int] = []
        done: list[Scheduled] = []
        offset = 0
        for it in items:
            request = it.seq.request
            if request.params.prompt_logits and it.seq.index == 0:
                if not request.prompt_logit_chunks:  # the first row computed: after the cached prefix
                    request.prompt_logits_start = it.start
                have = request.prompt_logits_start + sum(c.shape[0] for c in request.prompt_logit_chunks)
                lo, hi = max(have, it.start), min(request.num_prompt_tokens, it.start + it.num_tokens)
                if lo < hi:
                    part = hidden[offset + lo - it.start : offset + hi - it.start]
                    request.prompt_logit_chunks.append(self.model.logits(part).cpu())
            if it.completes:
                done.append(it)
                rows.append(offset + it.num_tokens - 1)
            offset += it.num_tokens
        logits = self.model.logits(hidden[torch.tensor(rows, dtype=torch.long, device=self.device)])
        return done, logits

    def close(self) -> None:
        if self._one_thread is not None:
            self._one_thread.close()

    @staticmethod
    def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        return sample(logits, [s.request.params for s in seqs], [s.generator for s in seqs])
