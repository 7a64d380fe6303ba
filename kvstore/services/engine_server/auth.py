"""Who a request is: its tenant, from the Bearer token (``--tokens``), or from the
``X-KVStore-Tenant`` header when a trusted front presents the router token (``--router-token``).

The tenant salts the request's block keys, so tenants never share cached blocks. It is never
taken from a request body. Without tokens the server is open (tenant "") and binds loopback
only. Tokens are compared by digest and never appear in logs, errors or metrics.
"""

from __future__ import annotations

import hmac

from kvstore.services.common.tokens import AuthError, Tokens
from kvstore.services.engine_server.errors import APIError, forbidden, unauthorized

TENANT_HEADER = "x-kvstore-tenant"
MAX_TENANT_LEN = 256


class Auth:
    def __init__(self, tokens_file: str | None, router_token: str | None) -> None:
        self.tokens = Tokens(None, tokens_file)
        self.router_token = router_token or None

    @property
    def is_open(self) -> bool:
        """No token of any kind is configured: every request is tenant ""."""
        return self.tokens.is_open and self.router_token is None

    def tenant(self, authorization: str | None, tenant_header: str | None) -> str:
        """The tenant of a request from its ``Authorization`` and ``X-KVStore-Tenant`` headers.

        Raises:
            APIError: 401 for a missing or unknown token; 403 for a tenant header without the
                router token, or a malformed one.
        """
        token = _bearer(authorization)
        if self.router_token is not None and token is not None and hmac.compare_digest(
                token.encode("utf-8", "replace"), self.router_token.encode("utf-8", "replace")):
            if tenant_header is None:
                return ""
            if len(tenant_header) > MAX_TENANT_LEN or not tenant_header.isprintable():
                raise forbidden(f"{TENANT_HEADER} must be printable and at most {MAX_TENANT_LEN} characters")
            return tenant_header
        if tenant_header is not None:
            raise forbidden(f"the {TENANT_HEADER} header is honoured only with the router token")
        if self.is_open:
            return ""
        if token is None or self.tokens.is_open:  # only the router token is configured
            raise unauthorized("missing token" if token is None else "unknown token")
        try:
            return self.tokens.authenticate(token).tenant
        except AuthError as exc:
            raise unauthorized(str(exc)) from None


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise APIError(401, "the Authorization header must be 'Bearer <token>'", "authentication_error",
                       None, "invalid_api_key")
    return value.strip()
