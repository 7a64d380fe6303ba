"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error the API reports to the client as JSON (never with secrets in the message)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key")


def forbidden(message: str) -> APIError:
    return APIError(403, message, "permission_error", None, None)


def draining() -> APIError:
    return APIError(503, "the server is shutting down and takes no new requests", "service_unavailable_error",
                    None, "draining")
