"""The gateway's one error type, in OpenAI's error shape.

Every refusal the gateway makes (bad request, bad key, unknown model, no
worker, upstream failure) is a `GatewayError`; the HTTP layer turns it into a
response with `status` and the body `to_body()`:

    {"error": {"message": "...", "type": "invalid_request_error",
               "param": "messages", "code": null}}

Pure: no I/O, no web framework.
"""

from __future__ import annotations

from typing import Any

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
PERMISSION = "permission_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
SERVER = "server_error"
SERVICE_UNAVAILABLE = "service_unavailable_error"

# Codes of worker-side failures (docs/gateway-errors.md says which are safe to retry).
WORKER_UNAVAILABLE = "worker_unavailable"  # the worker went away, froze or broke off: retry safe
GATEWAY_DRAINING = "gateway_draining"  # this gateway is shutting down: retry safe


class GatewayError(Exception):
    """An error with an HTTP status and OpenAI's `{"error": {...}}` body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if not 400 <= status <= 599:
            raise ValueError(f"status must be an HTTP error status (400..599), got {status}")
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        # Extra response headers, e.g. Retry-After on 503.
        self.headers: dict[str, str] = dict(headers or {})

    def to_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"GatewayError({self.status}, {self.message!r}, type={self.type!r}, param={self.param!r}, code={self.code!r})"


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> GatewayError:
    """400: the request is malformed (names the offending field in `param`)."""
    return GatewayError(400, message, type=INVALID_REQUEST, param=param, code=code)


def authentication(message: str = "Incorrect API key provided.", *, code: str | None = "invalid_api_key") -> GatewayError:
    """401: missing or wrong API key."""
    return GatewayError(401, message, type=AUTHENTICATION, code=code)


def not_found(message: str, *, param: str | None = None, code: str | None = None) -> GatewayError:
    """404: e.g. an unknown model (`param="model", code="model_not_found"`)."""
    return GatewayError(404, message, type=NOT_FOUND, param=param, code=code)


def model_not_found(model: str) -> GatewayError:
    return not_found(f"The model `{model}` does not exist.", param="model", code="model_not_found")


def payload_too_large(message: str) -> GatewayError:
    """413: the body exceeds the configured limit."""
    return GatewayError(413, message, type=INVALID_REQUEST, code="request_too_large")


def context_length_exceeded_chars(*, chars: int, context_length: int, max_token_chars: int, param: str) -> GatewayError:
    """400 before tokenizing: more characters than the context's tokens can cover."""
    return GatewayError(
        400,
        f"This model's maximum context length is {context_length} tokens. However, your {param} hold {chars} "
        f"characters, more than {context_length} tokens of at most {max_token_chars} characters each can hold. "
        f"Please reduce the length of the {param}.",
        type=INVALID_REQUEST,
        param=param,
        code="context_length_exceeded",
    )


def context_length_exceeded(*, prompt_tokens: int, max_tokens: int, context_length: int) -> GatewayError:
    """400 with the numbers, worded like OpenAI's own message."""
    return GatewayError(
        400,
        f"This model's maximum context length is {context_length} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
        "Please reduce the length of the messages or completion.",
        type=INVALID_REQUEST,
        param="messages",
        code="context_length_exceeded",
    )


def service_unavailable(message: str, *, retry_after_s: int = 1, code: str = "service_unavailable") -> GatewayError:
    """503 with Retry-After: no healthy worker for this request (or this gateway is draining)."""
    return GatewayError(503, message, type=SERVICE_UNAVAILABLE, code=code, headers={"Retry-After": str(retry_after_s)})


def server_error(message: str, *, code: str | None = None) -> GatewayError:
    """500: a bug or an upstream failure the client cannot fix."""
    return GatewayError(500, message, type=SERVER, code=code)


def upstream_error(message: str, *, status: int = 502, code: str | None = "upstream_error") -> GatewayError:
    """502/504: a worker failed or timed out."""
    return GatewayError(status, message, type=SERVER, code=code)
