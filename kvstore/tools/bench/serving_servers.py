"""The servers ``kvstore bench serving`` starts, one at a time, and vLLM's client that drives them.

``Server`` starts ``kvstore engine``, vLLM's OpenAI server, or that server with kvstore's
connector on a daemon, and stops it. vLLM runs in each configuration of its cores asked for
(``vllm_configs``): as shipped, which keeps ``VLLM_CPU_NUM_OF_RESERVED_CPU`` cores (one on a
small machine) off its model for its frontend, and with that set to a count (0: its model gets
every core, sharing them with its frontend and the client as the engine does); the benchmarks
compare the engine with the faster. ``run_client`` runs vLLM's benchmark client
(``vllm.benchmarks.serve``) in this process, as its command line would. Both the
prefix-repetition workloads (bench.serving) and the pool-overflow one (bench.serving_overflow)
use them. vLLM is imported only inside ``run_client``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.tools.bench.harness import start_service

SERVED = "bench"  # the model name both servers answer to
START_TIMEOUT_S = 600.0  # vLLM compiles its model at start: minutes on a small CPU


def _errors(log: Path) -> str:
    """The lines of a server's log that name an error (its root cause among them), else its end."""
    lines = log.read_text(errors="replace").splitlines()
    named = [line for line in lines if "Error" in line or "error:" in line]
    return "\n".join(named[-6:]) if named else "\n".join(lines[-20:])


def _wait_for_http(url: str, proc: subprocess.Popen[Any], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited ({proc.returncode}):\n{_errors(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"vLLM's server did not answer {url} in {START_TIMEOUT_S:.0f} s:\n{_errors(log)}")


SHIPPED = "shipped"  # --vllm-reserved-cpus' name for vLLM as shipped (the variable unset)


def vllm_configs(text: str) -> list[int | None]:
    """``--vllm-reserved-cpus``: a comma-separated list of core counts and ``shipped`` (None)."""
    configs: list[int | None] = []
    for item in text.split(","):
        item = item.strip()
        if item == SHIPPED:
            configs.append(None)
            continue
        try:
            configs.append(int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected core counts or {SHIPPED!r}, comma-separated, like "
                                             f"'{SHIPPED},0', got {text!r}") from None
    if len(set(configs)) != len(configs):
        raise argparse.ArgumentTypeError(f"a configuration named twice in {text!r}")
    return configs


def reserved_label(reserved: int | None) -> str:
    """A vLLM configuration's name in a table: ``as shipped`` or ``N reserved``."""
    return "as shipped" if reserved is None else f"{reserved} reserved"


def reserved_text(reserved: int | None) -> str:
    """A vLLM configuration in a table's prose: its name, then what it sets."""
    if reserved is None:
        return "as shipped (VLLM_CPU_NUM_OF_RESERVED_CPU unset: on 2 cores its model runs on 1)"
    return (f"{reserved_label(reserved)} (VLLM_CPU_NUM_OF_RESERVED_CPU={reserved}"
            + (": its model on every core)" if reserved == 0 else ")"))


@dataclass(frozen=True)
class Arm:
    """One server as a benchmark runs it: ``which`` is ``kvstore`` (``kvstore engine``), ``vllm``
    or ``vllm+kvstore`` (``Server``'s), ``reserved`` vLLM's ``VLLM_CPU_NUM_OF_RESERVED_CPU``
    (None: as shipped; always None for the engine)."""

    which: str
    reserved: int | None = None

    @property
    def name(self) -> str:
        """``kvstore``, or the vLLM server and its configuration (``vLLM as shipped``, ``vLLM 0 reserved``)."""
        if self.which == "kvstore":
            return "kvstore"
        return f"{'vLLM' if self.which == 'vllm' else self.which} {reserved_label(self.reserved)}"


class Server:
    """One server process, up for a round of workloads: ``kvstore`` (``kvstore engine``),
    ``vllm`` (vLLM's OpenAI server) or ``vllm+kvstore`` (the same with kvstore's connector on the
    daemon at ``store``). ``kv_bytes``: the device KV pool of either server (None: ``--kv-cache-gib``);
    ``reserved``: vLLM's ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (None: unset, as shipped)."""

    def __init__(self, which: str, args: argparse.Namespace, work: Path, port: int, kv_bytes: int | None = None,
                 store: str | None = None, max_model_len: int | None = None, reserved: int | None = None) -> None:
        model = args.bench_model
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[Any]
        kv_cache = str(kv_bytes if kv_bytes is not None else args.kv_cache_gib << 30)
        if which == "kvstore":
            # the random model as saved for vLLM: then both servers and the client share its tokenizer
            served = model.server_args() if model.path else ["--model", str(model.hf_dir(work))]
            cmd = [sys.executable, "-m", "kvstore.cli", "engine", *served, "--port", str(port),
                   "--served-model-name", SERVED, "--kv-cache", kv_cache, "--host-mem", f"{args.host_gib}GiB"]
            self.proc, _ = start_service(cmd, "kvstore engine")
            return
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model.hf_dir(work)),
               "--port", str(port), "--host", "127.0.0.1", "--served-model-name", SERVED, "--dtype", "float32",
               "--uvicorn-log-level", "warning"]
        cmd += ["--kv-cache-memory-bytes", kv_cache]
        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine core as vLLM ships it
        env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
        if reserved is not None:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved)
        if max_model_len is not None:  # vLLM refuses a KV cache smaller than one sequence of the model's length
            cmd += ["--max-model-len", str(max_model_len)]
        if args.enforce_eager:
            cmd.append("--enforce-eager")
        if which == "vllm+kvstore":
            assert store is not None
            connector = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.integrations.vllm",
                         "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                         "kv_connector_extra_config": {"store_url": store}}
            cmd += ["--distributed-executor-backend", "uni", "--kv-transfer-config", json.dumps(connector)]
        log = work / f"{which}-{reserved_label(reserved).replace(' ', '-')}-server-{port}.log"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _wait_for_http(f"{self.base_url}/v1/models", self.proc, log)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_client(flags: list[str]) -> dict[str, Any]:
    """vLLM's benchmark client, in this process, as its command line would run it."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return main(parser.parse_args(flags))
