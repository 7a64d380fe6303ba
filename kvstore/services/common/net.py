"""Listen addresses: ``HOST:PORT`` parsing and the loopback test behind every "off loopback
needs a token" rule (daemon, engine server, router)."""

from __future__ import annotations

import ipaddress

from kvstore.errors import ConfigError


def parse_hostport(text: str) -> tuple[str, int]:
    """``"127.0.0.1:7470"`` or ``"[::1]:7470"`` -> (host, port); an empty host is 127.0.0.1."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) < 65536:  # "²".isdigit()
        raise ConfigError(f"address {text!r} is not HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP address) only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
