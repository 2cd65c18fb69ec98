"""GatewayError bodies in OpenAI's exact error shape."""

from __future__ import annotations

import pytest

from kvserving.gateway import errors


def test_invalid_request_body_is_openai_shape() -> None:
    e = errors.invalid_request("bad role", param="messages[0].role", code="invalid_value")
    assert e.status == 400
    assert e.to_body() == {
        "error": {"message": "bad role", "type": "invalid_request_error", "param": "messages[0].role", "code": "invalid_value"}
    }
    assert str(e) == "bad role"


def test_helpers_set_status_type_and_code() -> None:
    cases = [
        (errors.authentication(), 401, "authentication_error", "invalid_api_key"),
        (errors.model_not_found("gpt-9"), 404, "not_found_error", "model_not_found"),
        (errors.payload_too_large("too big"), 413, "invalid_request_error", "request_too_large"),
        (errors.server_error("boom"), 500, "server_error", None),
        (errors.upstream_error("worker died"), 502, "server_error", "upstream_error"),
        (errors.service_unavailable("no worker", retry_after_s=3), 503, "service_unavailable_error", "service_unavailable"),
    ]
    for err, status, kind, code in cases:
        assert (err.status, err.type, err.code) == (status, kind, code)
    assert errors.model_not_found("gpt-9").to_body()["error"]["message"] == "The model `gpt-9` does not exist."
    assert errors.service_unavailable("x", retry_after_s=3).headers == {"Retry-After": "3"}


def test_context_length_message_has_the_numbers() -> None:
    e = errors.context_length_exceeded(prompt_tokens=5000, max_tokens=100, context_length=4096)
    assert e.param == "messages" and e.code == "context_length_exceeded"
    assert "maximum context length is 4096 tokens" in e.message and "5100 tokens (5000 in the messages, 100 in the completion)" in e.message


def test_status_must_be_an_error_status() -> None:
    with pytest.raises(ValueError, match="status"):
        errors.GatewayError(200, "ok")
