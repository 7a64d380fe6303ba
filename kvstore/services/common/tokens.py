"""Tenant tokens: the ``--tokens`` TOML file every service reads (daemon, engine server,
router) and the token -> Principal map built from it (docs/protocol.md).

Tokens are kept and compared by SHA-256 digest and never appear in errors. A tenant's table
may also hold its quotas (kvstore/policy/quotas.py), by tier::

    [[tenant]]
    name = "acme"
    tokens = ["..."]
    quota = { host = { soft = "40%", hard = "2GiB" }, disk = { soft = "25%" } }

``Tokens.tenants`` names the file's tenants in order (the daemon gives each an equal soft
share of every tier by default); ``Tokens.quotas`` holds the quotas the file sets.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.policy.quotas import QuotaTable
from kvstore.services.common.sizes import parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class Principal:
    """Who a token authenticates: a tenant, whether it is the admin, whether it may map shm."""

    tenant: str
    admin: bool = False
    shm: bool = True


class AuthError(Exception):
    """Missing or unknown token."""


class Tokens:
    """token -> Principal. Open (anonymous tenant "") only when no token is configured."""

    def __init__(self, admin_token: str | None, tokens_file: str | None) -> None:
        self._by_digest: dict[bytes, Principal] = {}
        self.tenants: tuple[str, ...] = ()  # the tokens file's tenants, in its order
        self.quotas = QuotaTable()  # the quotas the tokens file sets
        if admin_token:
            self._by_digest[_digest(admin_token)] = Principal("", admin=True)
        if tokens_file:
            found, self.quotas = _read_tokens_file(tokens_file)
            for token, principal in found:
                self._by_digest[_digest(token)] = principal
            self.tenants = tuple(dict.fromkeys(principal.tenant for _, principal in found))
        self.is_open = not self._by_digest
        self.has_admin = bool(admin_token)

    def authenticate(self, token: str | None) -> Principal:
        if self.is_open and not token:
            return Principal("")
        principal = self._by_digest.get(_digest(token or ""))
        if principal is None:
            raise AuthError("missing token" if not token else "unknown token")
        return principal


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "replace")).digest()


TENANT_KEYS = frozenset({"name", "tokens", "shm", "quota"})


def _read_tokens_file(path: str) -> tuple[list[tuple[str, Principal]], QuotaTable]:
    """``[[tenant]]`` tables: ``name = "acme"``, ``tokens = ["..."]``, optional ``shm = false``
    and ``quota = {tier = {soft = ..., hard = ...}}`` (kvstore/policy/quotas.py: bytes, "2GiB", a
    share, "25%").

    Raises:
        ConfigError: naming the file and the problem, for anything else: unknown keys (at the
            top or in a table), ``tenant`` not an array of tables, a table without a non-empty
            name and a non-empty list of non-empty tokens, a non-bool ``shm``, a token listed
            for two tenants, or no token at all (an empty file would leave the daemon open),
            or a bad quota (naming the tenant, the tier and the value). Errors never show a token.
    """
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, UnicodeDecodeError, RecursionError, tomllib.TOMLDecodeError) as exc:
        # (tomllib decodes the bytes itself, and nests by recursion: not UTF-8, or too deep)
        raise ConfigError(f"cannot read tokens file {path}: {exc}") from None
    unknown = sorted(set(doc) - {"tenant"})
    if unknown:
        raise ConfigError(f"tokens file {path}: unknown keys {unknown}; it holds [[tenant]] tables only")
    tenants = doc.get("tenant", [])
    if not isinstance(tenants, list) or not all(isinstance(item, dict) for item in tenants):
        raise ConfigError(f"tokens file {path}: 'tenant' must be an array of tables ([[tenant]]), "
                          f"got {type(tenants).__name__}")
    out: list[tuple[str, Principal]] = []
    owners: dict[str, str] = {}
    quotas: dict[str, object] = {}
    for i, item in enumerate(tenants):
        name, tokens, shm = item.get("name"), item.get("tokens"), item.get("shm", True)
        extra = sorted(set(item) - TENANT_KEYS)
        if extra:
            raise ConfigError(f"tokens file {path}: tenant #{i} has unknown keys {extra}; "
                              f"known: {sorted(TENANT_KEYS)}")
        named = isinstance(name, str) and name != ""
        listed = isinstance(tokens, list) and tokens != [] and all(isinstance(t, str) and t for t in tokens)
        if not named or not listed:
            raise ConfigError(f"tokens file {path}: tenant #{i} needs name = \"...\" and tokens = [\"...\"] "
                              "(non-empty strings)")
        if not isinstance(shm, bool):
            raise ConfigError(f"tokens file {path}: tenant #{i} ({name}): shm must be true or false, got {shm!r}")
        for token in tokens:
            if owners.setdefault(token, name) != name:
                raise ConfigError(f"tokens file {path}: a token of tenant {name!r} is also one of {owners[token]!r}")
        if "quota" in item:
            if name in quotas:
                raise ConfigError(f"tokens file {path}: tenant {name!r} has quota tables in two [[tenant]] entries")
            quotas[name] = item["quota"]
        out += [(t, Principal(name, shm=shm)) for t in tokens]
    if not out:
        raise ConfigError(f"tokens file {path} defines no token (add [[tenant]] tables with "
                          "name = \"...\" and tokens = [\"...\"])")
    return out, QuotaTable.from_dict(quotas, parse_size, where=f"tokens file {path}: quota")
