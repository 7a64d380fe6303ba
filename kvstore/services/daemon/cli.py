"""``kvstore serve``: run the daemon (block protocol + REST + dashboard)."""

from __future__ import annotations

import argparse
import sys

from kvstore import env
from kvstore.errors import ConfigError
from kvstore.services.common.store_args import add_store_arguments, store_flags_given
from kvstore.services.daemon.config import DEFAULT_QUOTAS, DEFAULT_STORE, FIXED_SETTINGS


def _addr(value: str) -> str:
    return "" if value.lower() in ("", "none", "off") else value


def run_serve(args: argparse.Namespace) -> int:
    from kvstore.services.daemon.config import load_config
    from kvstore.services.daemon.server import serve

    overrides = {
        "data_dir": args.data_dir,
        "socket_path": None if args.socket is None else _addr(args.socket),
        "listen": None if args.listen is None else _addr(args.listen),
        "http": None if args.http is None else _addr(args.http),
        "token": args.token or env.token(), "tokens_file": args.tokens,
        "max_namespaces": args.max_namespaces, "lease_s": args.lease_s, "shm": False if args.no_shm else None,
        "kv_events": args.kv_events, "kv_events_replay": args.kv_events_replay,
        "default_quotas": args.default_quotas,
        **store_flags_given(args),  # over the TOML file's store settings
    }
    try:
        return serve(load_config(args.config, overrides))
    except ConfigError as exc:  # a bad setting, an address it cannot listen on, a data dir in use
        print(f"kvstore serve: {exc}", file=sys.stderr)
        return 2


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="run the shared store daemon (block protocol, REST, dashboard)",
        description="Run the store as a daemon that several engine processes share. SIGTERM drains "
        "in-flight requests and exits 0 within 5 s; a second signal exits at once.",
    )
    p.add_argument("--data-dir", default=None, help="disk tier and catalog directory (default ./.kvstore)")
    p.add_argument("--socket", default=None, help="Unix socket path (default DIR/kvstore.sock; 'none' to disable)")
    p.add_argument("--listen", default=None, help="block protocol over TCP, HOST:PORT (default 127.0.0.1:7470)")
    p.add_argument("--http", default=None, help="REST and dashboard, HOST:PORT (default 127.0.0.1:7471)")
    p.add_argument("--token", default=None, help="admin token (or KVSTORE_TOKEN); required off loopback")
    p.add_argument("--tokens", default=None, help="TOML file mapping tenant tokens to tenants")
    p.add_argument("--config", default=None, help="TOML file with any of these settings, keys named as in "
                   "python (remote_url, disk_codec, host_bytes, ...; flags win)")
    p.add_argument("--max-namespaces", type=int, default=None, help="namespace slots sharing the capacity (default 4)")
    p.add_argument("--lease-s", type=float, default=None, help="shared-memory lease lifetime (default 10 s)")
    p.add_argument("--no-shm", action="store_true", help="do not offer the shared-memory path")
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish the tiers as KV events (vLLM's ZeroMQ format), e.g. tcp://127.0.0.1:5557")
    p.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                   help="the KV events replay/snapshot socket (default: the next port)")
    p.add_argument("--default-quotas", default=None, choices=list(DEFAULT_QUOTAS),
                   help="equal: each tenant of --tokens gets an equal soft share of every tier; none: only the "
                   "quotas the tokens file, --config's [quotas.TENANT] tables or POST /v1/admin/quotas set "
                   "(default equal; docs/eviction.md)")
    add_store_arguments(
        p, defaults=DEFAULT_STORE, without=tuple(FIXED_SETTINGS),
        shown={"host_bytes": "a tenth of RAM, at least 64MiB, at most 16GiB",
               "disk_bytes": "a tenth of the free space, at most 20GiB; 0: no disk tier"},
        description="Every namespace's store. --host-mem and --disk-size are totals, split evenly among "
        "--max-namespaces slots. The daemon decides three settings itself, so they have no flag here: "
        "the disk tier lives under --data-dir (no --disk-path), host RAM stays raw because clients put "
        "into and map its slots (no --host-codec), and each client picks its namespace's key hash "
        "(no --hash-algo).")
    p.set_defaults(func=run_serve)
