"""RouteConfig: every knob of ``kvstore route``, frozen and validated (the loopback rule too)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvstore.errors import ConfigError
from kvstore.services.common.net import is_loopback
from kvstore.services.common.tokens import Tokens
from kvstore.services.router.policy.config import RoutingPolicyConfig


@dataclass(frozen=True)
class RouteConfig:
    """Configuration of one ``kvstore route`` process.

    Attributes:
        replicas: the replicas' base URLs (``http://127.0.0.1:8001``); everything else about
            them is learned from their ``GET /v1/kvstore/info``.
        host, port: where the router listens (port 0: any free port, printed at start).
        tokens_file: TOML mapping the callers' Bearer tokens to tenants (docs/protocol.md);
            off loopback it must name at least one token (a file with none lets everyone in).
        router_token: the replicas' ``--router-token``: sent with every forwarded request, with
            the caller's tenant in ``X-KVStore-Tenant``. Required with ``tokens_file``.
        routing: the routing library's knobs (policy, weights, gate).
        health_interval_s: how often each replica's load (and so its health) is polled.
        dead_after_s: a replica that has not answered for this long is taken out.
        connect_timeout_s: a forward whose connection takes longer fails over to another replica.
        max_attempts: replicas tried per request before it fails (only attempts that never
            reached a replica are retried: nothing runs twice).
        drain_s: seconds SIGTERM waits for requests in flight.
    """

    replicas: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    tokens_file: str | None = None
    router_token: str | None = field(default=None, repr=False)
    routing: RoutingPolicyConfig = field(default_factory=RoutingPolicyConfig)
    health_interval_s: float = 0.25
    dead_after_s: float = 1.5
    connect_timeout_s: float = 1.0
    max_attempts: int = 3
    drain_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ConfigError("give at least one --replica URL")
        for url in self.replicas:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
                raise ConfigError(f"--replica must be a base URL like http://127.0.0.1:8001, got {url!r}")
        if len(set(self.urls)) != len(self.urls):
            raise ConfigError(f"each --replica may be given once, got {', '.join(self.replicas)}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0-65535, got {self.port}")
        if self.tokens_file and not self.router_token:
            raise ConfigError("--tokens needs --router-token: the replicas must trust the tenant the router names")
        if not is_loopback(self.host) and not self.tokens_file:
            raise ConfigError(f"--host {self.host} is off loopback: caller tokens (--tokens) are required")
        if not is_loopback(self.host) and Tokens(None, self.tokens_file).is_open:
            raise ConfigError(f"--host {self.host} is off loopback, but the tokens file {self.tokens_file} names "
                              "no token: everyone would be let in and forwarded with the router's token")
        for name in ("health_interval_s", "dead_after_s", "connect_timeout_s", "drain_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")

    @property
    def urls(self) -> tuple[str, ...]:
        """The replicas' URLs without a trailing slash (their names in the router)."""
        return tuple(url.rstrip("/") for url in self.replicas)
