"""OpenAI-shaped errors: ``{"error": {"message", "type", "code"}}`` with the right HTTP status."""

from __future__ import annotations

from typing import Any

import msgspec

from router.net.body import decode_json


class ApiError(Exception):
    """An error the client sees; ``status`` is the HTTP status."""

    def __init__(
        self, status: int, message: str, type_: str, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code or type_
        self.param = param

    def body(self) -> bytes:
        """The JSON body, as OpenAI and vLLM shape it."""
        return msgspec.json.encode(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        )


def json_body(raw: bytes) -> Any:
    """A request body decoded, or a 400: msgspec raises UnicodeDecodeError for invalid UTF-8 and
    RecursionError for ~1,000 nested arrays, not DecodeError (they were 500s, and a /route answered
    in the read callback lost its connection). A large body is decoded in pieces
    (:func:`router.net.body.decode_json`): call it off the event loop."""
    try:
        return decode_json(raw)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:
        raise bad_request(f"The body is not valid JSON: {exc}") from None


def bad_request(message: str, code: str = "invalid_request", param: str | None = None) -> ApiError:
    """400: the body is not a valid request (``param``: the offending field, when one is)."""
    return ApiError(400, message, "invalid_request_error", code, param)


def forbidden(message: str) -> ApiError:
    """403: the key is valid but not for this (a client key on the admin API)."""
    return ApiError(403, message, "permission_error", "forbidden")


def not_found(message: str, code: str = "not_found") -> ApiError:
    """404: no such resource (an unknown backend; the admin API when it is off)."""
    return ApiError(404, message, "invalid_request_error", code)


def unauthorized() -> ApiError:
    """401: missing or wrong API key."""
    return ApiError(
        401,
        "Missing or invalid API key (Authorization: Bearer <key>)",
        "authentication_error",
        "invalid_api_key",
    )


def not_found_model(model: str) -> ApiError:
    """404: no backend serves this model."""
    return ApiError(404, f"The model `{model}` does not exist", "invalid_request_error", "model_not_found")


def too_large(limit: int) -> ApiError:
    """413: body over the configured limit."""
    return ApiError(
        413, f"Request body larger than {limit} bytes", "invalid_request_error", "request_too_large"
    )


def head_too_large(limit: int) -> ApiError:
    """431: request line and headers over the server's limit."""
    return ApiError(431, f"request head larger than {limit} bytes", "invalid_request_error", "head_too_large")


def request_timeout(what: str, seconds: float) -> ApiError:
    """408: the request's head or body did not arrive within its deadline."""
    return ApiError(
        408,
        f"the request {what} did not arrive within {seconds:g} s",
        "invalid_request_error",
        "request_timeout",
    )


def too_many_connections(limit: int) -> ApiError:
    """503: the router holds as many client connections as it may (sent with a Retry-After)."""
    return ApiError(
        503,
        f"the router holds its maximum of {limit} client connections; retry later",
        "service_unavailable",
        "too_many_connections",
    )


def internal_error() -> ApiError:
    """500: a bug in kvrouter (logged with its traceback)."""
    return ApiError(500, "internal error in kvrouter", "internal_error", "internal_error")


def unavailable(message: str, code: str = "no_healthy_backend") -> ApiError:
    """503: no healthy backend for the model (``no_backend_yet``: none reached yet that may serve
    it). Sent with ``Retry-After`` (:func:`router.net.asgi.write_json`)."""
    return ApiError(503, message, "service_unavailable", code)


def bad_gateway(message: str) -> ApiError:
    """502: the backend could not be reached or broke the connection."""
    return ApiError(502, message, "upstream_error", "bad_gateway")


def gateway_timeout(message: str) -> ApiError:
    """504: the backend did not answer in time."""
    return ApiError(504, message, "upstream_timeout", "gateway_timeout")
