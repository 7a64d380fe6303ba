"""What every REST router shares: the request field types, the token dependencies, who sees
which tenants, and the route class of a deprecated alias.

Auth: reads are open on an open daemon (no tokens configured); with tokens they need one,
except ``/``, ``/healthz``, ``/metrics`` and ``/v1/tiers``. A tenant token sees its own tenant
only. ``Admin`` routes need the admin token: 401 without a valid token, 403 with a tenant
token. The dependencies find the registry in ``request.app.state.registry`` (create_app
puts it there). They live at module level: FastAPI resolves a route's (string) annotations
in the globals of the module that defines it, so a router module imports them by name.
"""

from __future__ import annotations

import logging
import threading
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.routing import APIRoute
from pydantic import Field
from starlette.types import Message, Receive, Scope, Send

from kvstore.services.common.tokens import AuthError, Principal
from kvstore.services.daemon.registry import NamespaceState, Registry

HEX_KEY = r"^[0-9a-fA-F]{32}([0-9a-fA-F]{32})?$"  # a 16- or 32-byte block key, hex
TokenId = Annotated[int, Field(ge=0, lt=1 << 32)]
HexKey = Annotated[str, Field(pattern=HEX_KEY)]
log = logging.getLogger("kvstore.services.daemon")


def caller(request: Request) -> Principal | None:
    """The bearer token's principal; None without a token (401 for an unknown one)."""
    header = request.headers.get("authorization", "")
    token = header[7:].strip() if header.lower().startswith("bearer ") else None
    if not token:
        return None
    try:
        return request.app.state.registry.tokens.authenticate(token)
    except AuthError:
        raise HTTPException(401, "unknown token") from None


def reader(request: Request, who: Annotated[Principal | None, Depends(caller)]) -> Principal:
    if who is None:
        if not request.app.state.registry.tokens.is_open:
            raise HTTPException(401, "a token is required (Authorization: Bearer TOKEN)")
        return Principal("", admin=False)
    return who


def admin(who: Annotated[Principal | None, Depends(caller)]) -> Principal:
    if who is None:
        raise HTTPException(401, "the admin token is required (Authorization: Bearer TOKEN)")
    if not who.admin:
        raise HTTPException(403, "this token is a tenant token; admin actions need the admin token")
    return who


Reader = Annotated[Principal, Depends(reader)]
Admin = Annotated[Principal, Depends(admin)]


def sees_all(registry: Registry, who: Principal) -> bool:
    """Whether ``who`` sees every tenant (the admin, or anyone on an open store)."""
    return who.admin or registry.tokens.is_open


def namespaces(registry: Registry, ns_id: str | None) -> list[NamespaceState]:
    """Every namespace, or the one named (404 if there is none of that id)."""
    if ns_id is None:
        return registry.namespaces()
    state = registry.get(ns_id)
    if state is None:
        raise HTTPException(404, f"no namespace {ns_id!r}")
    return [state]


_warned: set[str] = set()  # deprecated routes used since the process started
# When the aliases were deprecated (2026-12-07, 00:00 UTC), as RFC 9745's Deprecation header
# gives it: "@" and the seconds since the epoch.
DEPRECATED_SINCE = "@1796601600"
_warned_lock = threading.Lock()


def deprecated_alias(successor: str) -> type[APIRoute]:
    """The route class of a deprecated alias of the route at path ``successor``
    (docs/rest.md, "Deprecated routes"). Register the alias with ``deprecated=True`` (the
    OpenAPI schema says so) and ``route_class_override`` this class. It answers as it always
    did; every answer, errors included, carries ``Deprecation: @<when>`` (RFC 9745) and
    ``Link: <successor>; rel="successor-version"``, and its first use in the process logs a
    warning that names the successor."""
    headers = [(b"deprecation", DEPRECATED_SINCE.encode()),
               (b"link", f'<{successor}>; rel="successor-version"'.encode())]

    class DeprecatedAlias(APIRoute):
        async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
            method = "/".join(sorted(self.methods or ()))
            with _warned_lock:
                first = self.path not in _warned
                _warned.add(self.path)
            if first:
                log.warning("%s %s is deprecated: use %s %s instead (docs/rest.md, \"Deprecated routes\")",
                            method, self.path, method, successor)

            async def send_marked(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", ()), *headers]}
                await send(message)

            await super().handle(scope, receive, send_marked)

    return DeprecatedAlias
