"""``kvstore route``: a cache-aware router in front of ``kvstore engine`` replicas (docs/routing.md)."""

from __future__ import annotations

import argparse
import sys

from kvstore import env
from kvstore.errors import ConfigError
from kvstore.services.common.argtypes import port
from kvstore.services.router.policy.config import POLICIES


def run_route(args: argparse.Namespace) -> int:
    from kvstore.services.router.config import RouteConfig
    from kvstore.services.router.policy.config import RoutingPolicyConfig
    from kvstore.services.router.server import serve

    try:
        routing = RoutingPolicyConfig(policy=args.policy, gate_min_requests=args.gate_min_requests,
                               pending_ttl_s=args.pending_ttl, shared_remote=args.shared_remote)
        config = RouteConfig(tuple(args.replica or ()), host=args.host, port=args.port, tokens_file=args.tokens,
                             router_token=args.router_token or env.router_token(),
                             routing=routing, health_interval_s=args.health_interval, dead_after_s=args.dead_after,
                             drain_s=args.drain_s)
        return serve(config)
    except (ConfigError, ValueError) as exc:  # a bad flag, or an address that cannot be bound
        print(f"kvstore route: {exc}", file=sys.stderr)
        return 2


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "route", help="a cache-aware router in front of kvstore engine replicas",
        description="Serve the OpenAI API of kvstore engine and forward each request to the replica that holds "
        "its prefix (learned from the replicas' KV events), balanced against load. See docs/routing.md.")
    p.add_argument("--replica", action="append", metavar="URL",
                   help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat for each)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1; off loopback needs --tokens)")
    p.add_argument("--port", type=port, default=8000, help="listen port (default 8000; 0: any free port)")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware", help="routing policy (default cache_aware)")
    p.add_argument("--tokens", default=None, help="TOML file mapping callers' Bearer tokens to tenants")
    p.add_argument("--router-token", default=None,
                   help="the replicas' --router-token (default KVSTORE_ROUTER_TOKEN); needed with --tokens")
    p.add_argument("--gate-min-requests", type=int, default=16,
                   help="overload gate: in-flight requests above the least loaded replica before it applies (16)")
    p.add_argument("--pending-ttl", type=float, default=5.0, help="seconds a routed prefix counts as held (5)")
    p.add_argument("--shared-remote", action="store_true",
                   help="the replicas share one remote tier: a block any of them holds there counts for all")
    p.add_argument("--health-interval", type=float, default=0.25, help="seconds between load polls (0.25)")
    p.add_argument("--dead-after", type=float, default=1.5, help="a replica silent this long is out (1.5 s)")
    p.add_argument("--drain-s", type=float, default=10.0, help="SIGTERM waits this long for requests (default 10)")
    p.set_defaults(func=run_route)
