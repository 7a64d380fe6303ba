"""Run a plan of vLLM instances in this process and print one JSON result line (for the tests).

``python tests_vllm/vllm_run.py PLAN_JSON``. A plan is a list of steps:
  {"llm": {"model": DIR, "extra": {...} | null, "options": {...}}}
                                          start an LLM (null: no connector; options: more LLM(...)
                                          arguments, over the defaults), closing the last; reports
                                          its start time, whether vLLM's hybrid KV cache manager
                                          is on, and its KV cache groups [spec, window, layers]
  {"generate": [{"ids": [...], "salt": str | null, "embeds": {"n": N, "seed": S}, "params": {...}}, ...],
   "max_tokens": N, "logprobs": bool}     ("embeds": a prompt of N random embeddings instead of ids;
                                          "params": more SamplingParams arguments, e.g.
                                          skip_reading_prefix_cache, extra_args; "logprobs": report
                                          each sampled token's logprob too)
  {"kill": PID}                           SIGKILL a process (a daemon), and wait for it
  {"flip": {"path": FILE, "offset": N}}   flip one byte of a file (corrupt a block)
  {"stored": {"ids": [...], "path": FILE}}
                                          the blocks the embedded store holds for the unsalted prompt
                                          ``ids``: torch.save({block index: tensor}) to FILE; reports
                                          the indices held
Each generate step reports, per prompt: tokens (and logprobs), num_cached_tokens, and the
connector counters' change over the step.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in this process


def make_llm(model: str, extra: dict[str, Any] | None, **options: Any) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, distributed_executor_backend="uni",
                                  enforce_eager=True, seed=0)
    kwargs.update(options)
    if extra is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    return LLM(model=model, **kwargs)


def kv_cache_state(llm: Any) -> dict[str, Any]:
    """Whether vLLM kept its hybrid KV cache manager on, and each KV cache group's spec and window."""
    config = llm.llm_engine.vllm_config
    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    return {"hybrid": not config.scheduler_config.disable_hybrid_kv_cache_manager,
            "groups": [[type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None),
                        len(g.layer_names)] for g in groups]}


def counters() -> dict[str, int]:
    """The connector counters once its queued saves are done ({} when no connector ran)."""
    if "kvstore.integrations.vllm" not in sys.modules:
        return {}
    module = sys.modules["kvstore.integrations.vllm"]
    assert module.flush(60), "connector saves still running after 60 s"
    return module.counters()  # type: ignore[no-any-return]


def stored_blocks(ids: list[int], path: str) -> list[int]:
    """Save the embedded store's blocks of the unsalted prompt ``ids`` (see the module); their indices."""
    import torch

    from kvstore.integrations.vllm import backend

    (store,) = [entry[0] for entry in backend._EMBEDDED.values()]
    keys = store.block_keys(ids)
    held = [i for i, is_held in enumerate(store.contains(keys)) if is_held]
    torch.save({i: store.get([keys[i]])[0].clone() for i in held}, path)
    return held


def prompt_of(p: dict[str, Any], llm: Any) -> dict[str, Any]:
    if "embeds" in p:
        import torch

        hidden = llm.llm_engine.model_config.get_hidden_size()
        gen = torch.Generator().manual_seed(p["embeds"]["seed"])
        return {"prompt_embeds": torch.randn(p["embeds"]["n"], hidden, generator=gen)}
    prompt: dict[str, Any] = {"prompt_token_ids": p["ids"]}
    if p.get("salt"):
        prompt["cache_salt"] = p["salt"]
    return prompt


def main(plan: list[dict[str, Any]]) -> list[Any]:
    from vllm import SamplingParams

    results: list[Any] = []
    llm = None
    for step in plan:
        if "llm" in step:
            llm = None
            gc.collect()  # the previous instance's connectors shut down, its store closes
            started = time.perf_counter()
            llm = make_llm(step["llm"]["model"], step["llm"].get("extra"), **step["llm"].get("options", {}))
            results.append({"start_s": time.perf_counter() - started, **kv_cache_state(llm)})
        elif "generate" in step:
            assert llm is not None, "generate before llm"
            out = []
            for p in step["generate"]:  # one at a time: each prompt's counters are its own
                params = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0.0, ignore_eos=True,
                                        logprobs=0 if step.get("logprobs") else None, **p.get("params", {}))
                before = counters()
                r = llm.generate([prompt_of(p, llm)], params, use_tqdm=False)[0]
                after = counters()
                tokens = list(r.outputs[0].token_ids)
                out.append({"tokens": tokens, "cached": r.num_cached_tokens,
                            "counters": {k: v - before.get(k, 0) for k, v in after.items()}})
                if step.get("logprobs"):
                    out[-1]["logprobs"] = [lp[t].logprob for t, lp in zip(tokens, r.outputs[0].logprobs, strict=True)]
            results.append(out)
        elif "kill" in step:
            os.kill(step["kill"], signal.SIGKILL)
            results.append({"killed": step["kill"]})
        elif "flip" in step:
            with open(step["flip"]["path"], "r+b") as f:
                f.seek(step["flip"]["offset"])
                byte = f.read(1)
                f.seek(step["flip"]["offset"])
                f.write(bytes([byte[0] ^ 0xFF]))
            results.append({"flipped": step["flip"]})
        elif "stored" in step:
            results.append(stored_blocks(step["stored"]["ids"], step["stored"]["path"]))
    llm = None
    gc.collect()
    return results


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
