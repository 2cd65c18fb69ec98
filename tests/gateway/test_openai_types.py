"""Request parsing: what the gateway cannot honour is refused by name, neutral values pass."""

from __future__ import annotations

from typing import Any

import pytest

from kvserving.gateway.errors import GatewayError
from kvserving.gateway.openai_types import MAX_JSON_DEPTH, RequestLimits, parse_chat_request, parse_completion_request

BASE: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("extra", "param", "code", "words"),
    [
        ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_value", "only 0"),
        ({"frequency_penalty": -1}, "frequency_penalty", "unsupported_value", "only 0"),
        ({"frequency_penalty": 3}, "frequency_penalty", "invalid_value", "less than or equal to 2"),
        ({"logit_bias": {"50256": -100}}, "logit_bias", "unsupported_value", "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_value", "'json_object'"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
            "response_format",
            "unsupported_value",
            "'json_schema'",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value", "'yaml'"),
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice", "unsupported_value", "forces a tool call"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "read_file"}}},
            "tool_choice",
            "unsupported_value",
            "forces a tool call",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "invalid_value", "'sometimes'"),
        ({"top_logprobs": 2}, "top_logprobs", "unsupported_value", "top_logprobs"),
        ({"top_logprobs": 21}, "top_logprobs", "invalid_value", "less than or equal to 20"),
        ({"modalities": ["text", "audio"]}, "modalities", "unsupported_value", "only 'text'"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "unsupported_value", "Audio output"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "unsupported_value", "as 'tools'"),
        ({"function_call": {"name": "f"}}, "function_call", "unsupported_value", "as 'tools'"),
    ],
)
def test_chat_refuses_what_it_cannot_honour(extra: dict[str, Any], param: str, code: str, words: str) -> None:
    with pytest.raises(GatewayError) as got:
        parse_chat_request({**BASE, **extra})
    err = got.value.to_body()["error"]
    assert (got.value.status, err["param"], err["code"], err["type"]) == (400, param, code, "invalid_request_error")
    assert words in err["message"]


@pytest.mark.parametrize(
    "extra",
    [
        {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}},
        {"response_format": {"type": "text"}},
        {"tools": TOOLS, "tool_choice": "auto"},
        {"tools": TOOLS, "tool_choice": "none"},
        {"metadata": {"a": "b"}, "store": False, "parallel_tool_calls": True, "service_tier": "auto"},
        {"top_logprobs": 0, "modalities": ["text"], "functions": [], "function_call": "auto"},
        {"prediction": {"type": "content", "content": "x"}},
    ],
)
def test_chat_accepts_neutral_values(extra: dict[str, Any]) -> None:
    request = parse_chat_request({**BASE, **extra})
    assert request.messages == BASE["messages"]


def test_completions_refuse_what_they_cannot_honour() -> None:
    body = {"model": "m", "prompt": "hello"}
    assert parse_completion_request({**body, "presence_penalty": 0, "echo": False, "best_of": 1}).prompt == "hello"
    for extra, param in (
        ({"presence_penalty": 1}, "presence_penalty"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"echo": True}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 2}, "best_of"),
    ):
        with pytest.raises(GatewayError) as got:
            parse_completion_request({**body, **extra})
        err = got.value.to_body()["error"]
        assert (got.value.status, err["param"], err["code"]) == (400, param, "unsupported_value")
    with pytest.raises(GatewayError) as got:  # several prompts pass parsing; the route takes one
        parse_completion_request({**body, "prompt": ["a", "b"]}).single_prompt()
    assert (got.value.to_body()["error"]["param"], got.value.to_body()["error"]["code"]) == ("prompt", "unsupported_value")


def test_parallel_tool_calls_false_is_a_limit_of_one_call() -> None:
    assert parse_chat_request({**BASE, "tools": TOOLS, "parallel_tool_calls": False}).max_tool_calls == 1
    assert parse_chat_request({**BASE, "tools": TOOLS, "parallel_tool_calls": True}).max_tool_calls is None
    assert parse_chat_request({**BASE, "tools": TOOLS}).max_tool_calls is None


def _nested(levels: int) -> object:
    value: object = "x"
    for _ in range(levels):
        value = [value]
    return value


def test_nesting_is_refused_past_its_limit_and_surrogates_by_path() -> None:
    # the body object is level 1, "metadata"'s list level 2: MAX_JSON_DEPTH - 1 lists reach the limit
    assert parse_chat_request({**BASE, "metadata": _nested(MAX_JSON_DEPTH - 1)}).messages == BASE["messages"]
    with pytest.raises(GatewayError) as got:
        parse_chat_request({**BASE, "metadata": _nested(MAX_JSON_DEPTH)})
    assert (got.value.status, got.value.code, got.value.param) == (400, "invalid_json", None)
    pair = "\U0001f600"  # a surrogate pair in JSON ("\ud83d\ude00") is one character: accepted
    assert parse_chat_request({**BASE, "messages": [{"role": "user", "content": pair}]}).messages[0]["content"] == pair
    with pytest.raises(GatewayError) as got:
        parse_chat_request({**BASE, "tools": [{"type": "function", "function": {"name": "f", "description": "\ude00"}}]})
    assert (got.value.code, got.value.param) == ("invalid_value", "tools[0].function.description")


def test_the_prompt_is_sized_in_characters_before_it_is_rendered() -> None:
    limits = RequestLimits(max_model_len=10, max_token_chars=4)  # at most 40 characters of prompt text
    fits = {**BASE, "messages": [{"role": "user", "content": "x" * 30}]}  # 45 characters with "role", "user", "content"
    assert parse_chat_request(fits, limits=RequestLimits(max_model_len=10, max_token_chars=5)).messages
    with pytest.raises(GatewayError) as got:
        parse_chat_request(fits, limits=limits)
    err = got.value.to_body()["error"]
    assert (got.value.status, err["code"], err["param"]) == (400, "context_length_exceeded", "messages")
    assert "hold 45 characters" in err["message"] and "10 tokens of at most 4 characters" in err["message"]
    with pytest.raises(GatewayError) as got:
        parse_completion_request({"model": "m", "prompt": "y" * 41}, limits=limits)
    assert (got.value.code, got.value.param) == ("context_length_exceeded", "prompt")
    assert parse_completion_request({"model": "m", "prompt": "y" * 40}, limits=limits).prompt == "y" * 40
