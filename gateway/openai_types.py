"""OpenAI wire types: request models (pydantic) and response builders (plain dicts).

Requests are parsed with ``parse_chat_request`` / ``parse_completion_request``
(both completion routes, before anything renders or tokenizes the request),
which turn every validation failure into a 400 ``GatewayError`` naming the
field (``param``) the way OpenAI does: JSON nested past ``MAX_JSON_DEPTH``, a
string with an unpaired surrogate, a value of the wrong type (strict: no
coercion of ``"5"`` or ``"yes"``), an integer out of its range, a ``tool``
message without ``tool_call_id``, and a prompt of more characters than the
context's tokens can hold (``RequestLimits``: ``context_length_exceeded``). Fields OpenAI clients send that do not
change the result here (``metadata``, ``store``, ``service_tier``,
``prediction``, ...) are accepted and ignored, and so are the neutral values
of those that would (``presence_penalty: 0``, ``response_format: {"type":
"text"}``, ``tool_choice: "auto"``, ``modalities: ["text"]``);
``parallel_tool_calls: false`` is honoured (at most one tool call is returned);
values whose meaning the gateway cannot honour are refused clearly (400, code
``unsupported_value``) rather than answered as if they had been: ``n`` > 1,
``logprobs`` and ``top_logprobs``, ``echo``, ``suffix``, ``best_of`` > 1,
non-zero presence / frequency penalties, ``logit_bias``, a JSON
``response_format`` (nothing constrains the output to JSON), a ``tool_choice``
that forces a tool call ("required" or a named function: nothing forces the
model to call one), audio output (``modalities`` other than "text",
``audio``) and the legacy ``functions`` / ``function_call`` (they would be
dropped from the prompt: send ``tools``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import is_
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import GatewayError, context_length_exceeded_chars, invalid_request

# JSON nesting the gateway reads (a tool's parameter schema nests a few levels per
# property; templates and validators recurse once per level).
MAX_JSON_DEPTH = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a request may hold, from the served model: its prompt text may not have more
    characters than ``max_model_len`` tokens can cover (``max_token_chars`` each at most),
    or it cannot fit whatever it tokenizes to: refused before anything renders it."""

    max_model_len: int
    max_token_chars: int

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * self.max_token_chars


# Strict: a value of the wrong JSON type is refused, never coerced ("5" is no max_tokens,
# "yes" no stream); integers are bounded where the workers' are (seeds are 64-bit).
_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = _STRICT

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)  # vLLM extension; 0 = off
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    ignore_eos: bool = False
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM's: requests share reused KV only with requests of the same salt (tenants.py); "" or longer: 400
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # Characters of the prompt's strings (messages and tools, or prompt), counted by the parse: a
    # slot, not a pydantic private attribute (those cost every instance a post-init step and every
    # read a trip through ``BaseModel.__getattr__``); no body field can set it.
    __slots__ = ("_prompt_chars",)

    @property
    def prompt_chars(self) -> int:
        """Characters of the prompt's strings (keys too), as the parse counted them (0 when not parsed by it)."""
        chars: int = getattr(self, "_prompt_chars", 0)
        return chars

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    def check_supported(self) -> None:
        """Refuse (400) what this server cannot honour; subclasses add their own fields' checks."""
        if self.n not in (None, 1):
            raise _unsupported(f"n={self.n} is not supported: this server returns one choice per request (n=1).", "n")
        if self.logprobs:
            raise _unsupported("logprobs are not supported by this server.", "logprobs")
        if self.top_logprobs:
            raise _unsupported("top_logprobs are not supported by this server (logprobs are not).", "top_logprobs")
        if self.stream_options is not None and not self.stream:
            raise invalid_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options")
        if len(self.stop_strings()) > 4:
            raise invalid_request("'stop' may hold at most 4 sequences.", param="stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise _unsupported(f"{name} is not supported by this server (only 0).", name)
        if self.logit_bias:
            raise _unsupported("logit_bias is not supported by this server.", "logit_bias")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``; ``messages`` are checked in depth by the chat template."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension (e.g. enable_thinking)
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None  # legacy function calling
    function_call: str | dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if any(m != "text" for m in self.modalities or ()):
            raise _unsupported("Only text output is supported by this server: 'modalities' may hold only 'text'.", "modalities")
        if self.audio is not None:
            raise _unsupported("Audio output is not supported by this server.", "audio")
        if self.functions or self.function_call not in (None, "none", "auto"):
            name = "functions" if self.functions else "function_call"
            raise _unsupported(
                f"The legacy '{name}' parameter is not supported by this server: send the functions as 'tools' (and 'tool_choice').", name
            )
        kind = None if self.response_format is None else self.response_format.get("type")
        if self.response_format is not None and kind != "text":
            if kind in ("json_object", "json_schema"):
                raise _unsupported(
                    f"response_format type '{kind}' is not supported by this server: nothing constrains the output to JSON (only 'text').",
                    "response_format",
                )
            raise invalid_request(
                f"Invalid value for 'response_format.type': {kind!r} (one of 'text', 'json_object', 'json_schema').",
                param="response_format.type",
                code="invalid_value",
            )
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none"):
            return
        if choice == "required" or isinstance(choice, dict):
            raise _unsupported(
                "tool_choice that forces a tool call ('required' or a named function) is not "
                "supported by this server: nothing forces the model to call one (use 'auto' or "
                "'none').",
                "tool_choice",
            )
        raise invalid_request(
            f"Invalid value for 'tool_choice': {choice!r} (one of 'none', 'auto', 'required' or a named function).",
            param="tool_choice",
            code="invalid_value",
        )

    @property
    def parses_tool_calls(self) -> bool:
        """Tool calls are parsed out of the output when tools are offered and not switched off."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def max_tool_calls(self) -> int | None:
        """At most one tool call when the client set ``parallel_tool_calls: false``; else no limit."""
        return 1 if self.parallel_tool_calls is False else None

    @property
    def limit(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: a string or one token-id list."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=128)
    prompt_cache_key: str | None = None

    @property
    def limit(self) -> int:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default for completions

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise _unsupported("echo is not supported by this server.", "echo")
        if self.suffix:
            raise _unsupported("suffix is not supported by this server.", "suffix")
        if self.best_of not in (None, 1):
            raise _unsupported("best_of > 1 is not supported by this server.", "best_of")

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise _unsupported("Only one prompt per request is supported.", "prompt")
            prompt = prompt[0]  # type: ignore[assignment]
        if not prompt:
            raise invalid_request("'prompt' must not be empty.", param="prompt")
        return prompt  # type: ignore[return-value]


def _unsupported(message: str, param: str) -> GatewayError:
    """A value this server cannot honour: refused rather than answered as if it had been."""
    return invalid_request(message, param=param, code="unsupported_value")


def _validation_error(exc: ValidationError) -> GatewayError:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ())]
    param = loc[0] if loc else None
    where = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc).lstrip(".")
    kind = first.get("type", "")
    if kind == "missing":
        message = f"Missing required parameter: '{where}'."
        return invalid_request(message, param=param, code="missing_required_parameter")
    return invalid_request(
        f"Invalid value for '{where}': {first.get('msg', 'invalid')}.",
        param=param,
        code="invalid_value" if "type" not in kind else "invalid_type",
    )


def decode_json(raw: bytes) -> Any:
    """The request body as JSON: 400 ``invalid_json`` for bytes that are not JSON (or nest
    past the parser's recursion limit)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid_request(f"We could not parse the JSON body of your request: {exc}.", code="invalid_json") from exc


def parse_chat_request(body: Any, *, limits: RequestLimits | None = None) -> ChatCompletionRequest:
    """``POST /v1/chat/completions``: every check that needs no template, in one place
    (the JSON's shape, types and ranges, the tool messages' ids, the prompt's size)."""
    chars = _check_body(body, prompt_fields=("messages", "tools"))
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    if not request.messages:
        raise invalid_request("'messages' must contain at least one message.", param="messages", code="empty_array")
    for i, message in enumerate(request.messages):
        if message.get("role") == "tool" and not isinstance(message.get("tool_call_id"), str):
            param = f"messages[{i}].tool_call_id"
            if message.get("tool_call_id") is None:
                raise invalid_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
            raise invalid_request(f"Invalid type for '{param}': expected a string.", param=param, code="invalid_type")
    request.check_supported()
    _check_size(chars, limits, param="messages")
    object.__setattr__(request, "_prompt_chars", chars)  # a slot (see _SamplingFields), past pydantic's field checks
    return request


def parse_completion_request(body: Any, *, limits: RequestLimits | None = None) -> CompletionRequest:
    """``POST /v1/completions``: as ``parse_chat_request``."""
    chars = _check_body(body, prompt_fields=("prompt",))
    try:
        request = CompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    request.check_supported()
    _check_size(chars, limits, param="prompt")
    return request


def _check_body(body: Any, *, prompt_fields: tuple[str, ...]) -> int:
    """Refuse a body that is no object, nests deeper than ``MAX_JSON_DEPTH`` or holds a
    string that is not Unicode (an unpaired surrogate: ``"\\ud800"``); the characters of
    the strings under ``prompt_fields`` (keys too: tool schemas render theirs)."""
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    chars = 0
    for key, value in body.items():
        n, odd = _scan(value)
        if odd and (where := _surrogate_at(value, key)) is not None:
            raise invalid_request(
                f"Invalid value for '{where}': the string holds an unpaired UTF-16 surrogate, which is not a Unicode character.",
                param=where,
                code="invalid_value",
            )
        if key in prompt_fields:
            chars += n
    return chars


def _scan(root: Any) -> tuple[int, bool]:
    """Characters of the strings in a JSON value (keys too), and whether any string is not
    ASCII; raises past ``MAX_JSON_DEPTH``. One level at a time: no recursion to exhaust, and
    each level in a few C passes (its strings, its objects' keys and values, its arrays'
    items), not a Python step per value."""
    kind = type(root)
    if kind is str:
        return len(root), not root.isascii()
    if kind is not dict and kind is not list:
        return 0, False
    chars, odd, level, depth = 0, False, [root], 2  # the body object is depth 1
    while level:
        kinds = list(map(type, level))
        strings = list(compress(level, map(is_, kinds, repeat(str))))
        objects = list(compress(level, map(is_, kinds, repeat(dict))))
        keys = list(chain.from_iterable(objects))
        chars += sum(map(len, strings)) + sum(map(len, keys))
        odd = odd or not all(map(str.isascii, strings)) or not all(map(str.isascii, keys))
        arrays = compress(level, map(is_, kinds, repeat(list)))
        below = list(chain(chain.from_iterable(map(dict.values, objects)), chain.from_iterable(arrays)))
        if below and depth >= MAX_JSON_DEPTH and any(type(v) in (dict, list) for v in below):
            raise _too_deep()
        level, depth = below, depth + 1
    return chars, odd


def _surrogate_at(value: Any, where: str) -> str | None:
    """The path (``messages[0].content``) of the first string in ``value`` holding an unpaired
    surrogate (a string JSON decodes from a lone ``\\ud800``), or None."""
    if isinstance(value, str):
        return where if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            if _SURROGATE.search(k):
                return where
            if (found := _surrogate_at(v, f"{where}.{k}")) is not None:
                return found
    if isinstance(value, list):
        for i, v in enumerate(value):
            if (found := _surrogate_at(v, f"{where}[{i}]")) is not None:
                return found
    return None


def _check_size(chars: int, limits: RequestLimits | None, *, param: str) -> None:
    if limits is not None and chars > limits.max_prompt_chars:
        raise context_length_exceeded_chars(
            chars=chars, context_length=limits.max_model_len, max_token_chars=limits.max_token_chars, param=param
        )


def _too_deep() -> GatewayError:
    return invalid_request(f"The JSON body of your request nests deeper than {MAX_JSON_DEPTH} levels.", code="invalid_json")


# ---------------------------------------------------------------- responses

FinishReason = Literal["stop", "length", "tool_calls"]


def usage(*, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_message(*, content: str | None, reasoning: str | None = None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def chat_completion(
    *,
    id: str,
    created: int,
    model: str,
    message: dict[str, Any],
    finish_reason: str,
    usage: dict[str, Any],  # noqa: A002
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage,
    }


def chat_chunk(
    *,
    id: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,  # noqa: A002
    usage: dict[str, Any] | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``delta=None`` is the usage-only chunk (no choices)."""
    chunk: dict[str, Any] = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = usage
    return chunk


def completion(
    *,
    id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    usage: dict[str, Any],  # noqa: A002
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage,
    }


def completion_chunk(
    *,
    id: str,
    created: int,
    model: str,
    text: str | None,
    finish_reason: str | None = None,  # noqa: A002
    usage: dict[str, Any] | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = usage
    return chunk


def models_list(*, name: str, created: int, owned_by: str = "kvserving", max_model_len: int | None = None) -> dict[str, Any]:
    model: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": owned_by}
    if max_model_len is not None:
        model["max_model_len"] = max_model_len
    return {"object": "list", "data": [model]}
