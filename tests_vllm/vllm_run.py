"""Run a plan of vLLM instances in this process and print one JSON result line (for the tests).

``python tests_vllm/vllm_run.py PLAN_JSON``. A plan is a list of steps:
  {"llm": {"model": DIR, "extra": {...} | null}}   start an LLM (null: no connector), closing the last
  {"generate": [{"ids": [...], "salt": str | null}, ...], "max_tokens": N}
  {"kill": PID}                                      SIGKILL a process (a daemon), and wait for it
  {"flip": {"path": FILE, "offset": N}}              flip one byte of a file (corrupt a block)
Each generate step reports, per prompt: tokens, num_cached_tokens, and the connector counters'
change over the step.
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


def make_llm(model: str, extra: dict[str, Any] | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if extra is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    return LLM(model=model, dtype="float32", kv_cache_memory_bytes=64 << 20, distributed_executor_backend="uni",
               enforce_eager=True, seed=0, **kwargs)


def counters() -> dict[str, int]:
    """The connector counters once its queued saves are done ({} when no connector ran)."""
    if "kvstore.integrations.vllm" not in sys.modules:
        return {}
    module = sys.modules["kvstore.integrations.vllm"]
    assert module.flush(60), "connector saves still running after 60 s"
    return module.counters()  # type: ignore[no-any-return]


def main(plan: list[dict[str, Any]]) -> list[Any]:
    from vllm import SamplingParams

    results: list[Any] = []
    llm = None
    for step in plan:
        if "llm" in step:
            llm = None
            gc.collect()  # the previous instance's connectors shut down, its store closes
            started = time.perf_counter()
            llm = make_llm(step["llm"]["model"], step["llm"].get("extra"))
            results.append({"start_s": time.perf_counter() - started})
        elif "generate" in step:
            assert llm is not None, "generate before llm"
            params = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0.0, ignore_eos=True)
            out = []
            for p in step["generate"]:  # one at a time: each prompt's counters are its own
                before = counters()
                prompt: dict[str, Any] = {"prompt_token_ids": p["ids"]}
                if p.get("salt"):
                    prompt["cache_salt"] = p["salt"]
                r = llm.generate([prompt], params, use_tqdm=False)[0]
                after = counters()
                out.append({"tokens": list(r.outputs[0].token_ids), "cached": r.num_cached_tokens,
                            "counters": {k: v - before.get(k, 0) for k, v in after.items()}})
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
    llm = None
    gc.collect()
    return results


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
