"""``kvstore serve``: run the daemon (block protocol + REST + dashboard)."""

from __future__ import annotations

import argparse
import sys

from kvstore import env
from kvstore.codecs import CODECS
from kvstore.errors import ConfigError


def _addr(value: str) -> str:
    return "" if value.lower() in ("", "none", "off") else value


def run_serve(args: argparse.Namespace) -> int:
    from kvstore.services.daemon.config import load_config
    from kvstore.services.daemon.server import serve

    overrides = {
        "data_dir": args.data_dir, "host_bytes": args.host_mem, "disk_bytes": args.disk,
        "socket_path": None if args.socket is None else _addr(args.socket),
        "listen": None if args.listen is None else _addr(args.listen),
        "http": None if args.http is None else _addr(args.http),
        "token": args.token or env.token(), "tokens_file": args.tokens,
        "max_namespaces": args.max_namespaces, "write_policy": args.write_policy,
        "lease_s": args.lease_s, "shm": False if args.no_shm else None,
        "kv_events": args.kv_events, "kv_events_replay": args.kv_events_replay,
        "disk_codec": args.disk_codec, "remote_codec": args.remote_codec,
        "remote": args.remote, "remote_writes": args.remote_writes, "remote_timeout_s": args.remote_timeout,
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
    p.add_argument("--host-mem", default=None, help="total host RAM, e.g. 512MiB "
                   "(default: a tenth of RAM, at least 64MiB, at most 16GiB)")
    p.add_argument("--disk", default=None, help="total disk tier, e.g. 20GiB, 0 for none "
                   "(default: a tenth of the free space, at most 20GiB)")
    p.add_argument("--socket", default=None, help="Unix socket path (default DIR/kvstore.sock; 'none' to disable)")
    p.add_argument("--listen", default=None, help="block protocol over TCP, HOST:PORT (default 127.0.0.1:7470)")
    p.add_argument("--http", default=None, help="REST and dashboard, HOST:PORT (default 127.0.0.1:7471)")
    p.add_argument("--token", default=None, help="admin token (or KVSTORE_TOKEN); required off loopback")
    p.add_argument("--tokens", default=None, help="TOML file mapping tenant tokens to tenants")
    p.add_argument("--config", default=None, help="TOML file with any of these settings (flags win)")
    p.add_argument("--max-namespaces", type=int, default=None, help="namespace slots sharing the capacity (default 4)")
    p.add_argument("--write-policy", default=None, choices=["write_through", "write_back"],
                   help="write_through (default): an acknowledged put is on disk")
    p.add_argument("--lease-s", type=float, default=None, help="shared-memory lease lifetime (default 10 s)")
    p.add_argument("--no-shm", action="store_true", help="do not offer the shared-memory path")
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish the tiers as KV events (vLLM's ZeroMQ format), e.g. tcp://127.0.0.1:5557")
    p.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                   help="the KV events replay/snapshot socket (default: the next port)")
    p.add_argument("--disk-codec", default=None, choices=list(CODECS),
                   help="how the disk tier stores blocks: none (default, the bytes put) or a lossy "
                   "codec (int8: about half the bytes, so twice the blocks fit)")
    p.add_argument("--remote-codec", default=None, choices=list(CODECS),
                   help="the same for the remote tier (--remote)")
    p.add_argument("--remote", default=None, metavar="URL",
                   help="a remote tier shared with other nodes: redis+cluster://HOST:PORT[,HOST:PORT...] "
                   "or redis://HOST:PORT (docs/remote.md; put a password in the TOML key instead)")
    p.add_argument("--remote-writes", default=None, choices=["put", "demote"],
                   help="which blocks go remote: every put (default) or only those leaving the node")
    p.add_argument("--remote-timeout", type=float, default=None, metavar="SECONDS",
                   help="the remote tier's socket timeout and per-call deadline (default 0.5)")
    p.set_defaults(func=run_serve)
