"""Remote tier URLs: which Redis to reach and how. The password is kept, never printed.

    redis://[user:pass@]host:port[/db]                 one server
    rediss://...                                       the same over TLS
    redis+cluster://[user:pass@]host:port[,host:port]  seed nodes of a Redis Cluster
    rediss+cluster://...                               the same over TLS

User and password are percent-decoded. A URL that does not parse is a ValueError whose
message shows the URL with its password replaced by ``***``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import unquote

DEFAULT_PORT = 6379
SCHEMES = {  # scheme -> (cluster, tls)
    "redis": (False, False),
    "rediss": (False, True),
    "redis+cluster": (True, False),
    "rediss+cluster": (True, True),
}

Node = tuple[str, int]


@dataclass(frozen=True)
class RemoteURL:
    """A parsed remote URL. ``str()`` and ``repr()`` never show the password."""

    nodes: tuple[Node, ...]
    cluster: bool
    tls: bool
    username: str | None = None
    password: str | None = field(default=None, repr=False, compare=False)
    db: int = 0

    def redacted(self) -> str:
        """The URL as text, with ``***`` for the password."""
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        auth = ""
        if self.username or self.password:
            auth = (self.username or "") + (":***" if self.password else "") + "@"
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        db = f"/{self.db}" if self.db else ""
        return f"{scheme}://{auth}{hosts}{db}"

    def __str__(self) -> str:
        return self.redacted()

    def __repr__(self) -> str:
        return f"RemoteURL({self.redacted()!r})"


def redact(url: str) -> str:
    """``url`` with whatever sits between ``://`` and the last ``@`` of its authority hidden."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    _userinfo, _, hosts = rest.rpartition("@")
    return f"{scheme}://***@{hosts}"


def parse_url(url: str) -> RemoteURL:
    """Parse a remote URL (see the module docstring).

    Raises:
        ValueError: unknown scheme, no host, a bad port, a db on a cluster, or query text;
            the message shows the URL redacted.
    """
    if not isinstance(url, str):
        raise ValueError(f"remote URL must be a string, got {type(url).__name__}")
    shown = redact(url)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError(f"remote URL {shown!r}: scheme must be one of {sorted(SCHEMES)}")
    cluster, tls = SCHEMES[scheme.lower()]
    if "?" in rest or "#" in rest:
        raise ValueError(f"remote URL {shown!r}: query and fragment are not supported")
    username = password = None
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    hosts, slash, db_text = rest.partition("/")
    db = 0
    if slash and db_text:
        if not db_text.isdigit():
            raise ValueError(f"remote URL {shown!r}: database must be a number, got {db_text!r}")
        db = int(db_text)
        if cluster and db:
            raise ValueError(f"remote URL {shown!r}: a Redis Cluster has only database 0")
    nodes = tuple(_parse_node(part, shown) for part in hosts.split(","))
    if not cluster and len(nodes) != 1:
        raise ValueError(f"remote URL {shown!r}: redis:// names one server; use redis+cluster:// for seeds")
    return RemoteURL(nodes, cluster, tls, username, password, db)


def _parse_node(text: str, shown: str) -> Node:
    text = text.strip()
    if text.startswith("["):  # [v6 address]:port
        host, _, tail = text[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ValueError(f"remote URL {shown!r}: a node has no host ({text!r})")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"remote URL {shown!r}: bad port {port_text!r}")
    return host, int(port_text)
