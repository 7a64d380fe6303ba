"""The tenant tokens file (``--tokens FILE``) every service reads at start: ``Tokens(admin,
path)`` (kvstore/services/common/tokens.py), its ``[[tenant]]`` tables and their quotas.

Input: the whole file. The harness writes it to one temporary path and loads it as the daemon
does. What must hold:

- a file it refuses is a ConfigError (never a TOML, Unicode, Key or TypeError, a
  RecursionError or a crash of the quota parser);
- a file it accepts maps each token of each table to its tenant and ``shm`` flag, names the
  tenants in the file's order, refuses a missing or an unknown token with AuthError, is not
  open, and holds quotas only for its tenants; its quota table, written back as the REST API
  shows it (``as_dict``), reads back the same.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.policy.quotas import QuotaTable
from kvstore.services.common.sizes import parse_size
from kvstore.services.common.tokens import AuthError, Principal, Tokens

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def make() -> Callable[[bytes], None]:
    root = Path(tempfile.mkdtemp(prefix="kvstore-fuzz-tokens-"))
    atexit.register(shutil.rmtree, root, True)
    path = root / "tokens.toml"

    def check(data: bytes) -> None:
        path.write_bytes(data)
        try:
            tokens = Tokens(None, str(path))
        except ConfigError:
            return
        tables = tomllib.loads(data.decode())["tenant"]  # it was read: it is TOML of [[tenant]] tables
        expected = {token: Principal(t["name"], shm=t.get("shm", True)) for t in tables for token in t["tokens"]}
        assert tokens.tenants == tuple(dict.fromkeys(t["name"] for t in tables)), tokens.tenants
        for token, principal in expected.items():
            assert tokens.authenticate(token) == principal, (token, principal)
        assert not tokens.is_open and not tokens.has_admin
        for token in (None, "", "".join(expected) + "?"):  # longer than any token of the file
            try:
                tokens.authenticate(token)
            except AuthError:
                continue
            raise AssertionError(f"token {token!r:.40} authenticated")
        assert set(tokens.quotas.tenants) <= set(tokens.tenants), (tokens.quotas.tenants, tokens.tenants)
        shown = tokens.quotas.as_dict()
        assert QuotaTable.from_dict(shown, parse_size).as_dict() == shown, shown

    return check


def seeds() -> dict[str, bytes]:
    """docs/protocol.md's example, the tests' two tenants, and quotas of every form (bytes,
    sizes with units, shares, percentages, the ``"*"`` tier)."""
    return {
        "protocol-doc": b'[[tenant]]\nname = "acme"\ntokens = ["s3cret-acme-1", "s3cret-acme-2"]\n'
                        b"shm = true          # optional: may this tenant map the shared pool (default true)\n",
        "two-tenants": b'[[tenant]]\nname = "acme"\ntokens = ["tok-acme", "tok-acme-2"]\n\n'
                       b'[[tenant]]\nname = "beta"\ntokens = ["tok-beta"]\nshm = false\n',
        "quotas": b'[[tenant]]\nname = "acme"\ntokens = ["tok-acme"]\n'
                  b'quota = { host = { soft = "40%", hard = "2GiB" }, disk = { soft = "25%" } }\n\n'
                  b'[[tenant]]\nname = "flood"\ntokens = ["tok-flood"]\n'
                  b'quota = { "*" = { soft = 0.25 }, host = { soft = 1048576, hard = "1.5 MiB" } }\n\n'
                  b'[[tenant]]\nname = "globex"\ntokens = ["tok-globex"]\n[tenant.quota.host]\nsoft = "12.5%"\n'
                  b'hard = "100%"\n',
    }
