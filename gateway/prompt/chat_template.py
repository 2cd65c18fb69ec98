"""The model's own chat template: load it, check OpenAI messages, render them.

The template comes from the model directory (`chat_template.jinja` and
`additional_chat_templates/*.jinja`, else the `chat_template` field of
`tokenizer_config.json`; of several named templates `tool_use` is picked
when tools are given, else `default`, as `transformers` does) and is
rendered in the same jinja2 sandbox as `transformers`:
`ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks, loopcontrols)` with
`raise_exception`, a `tojson` that does not escape HTML, `strftime_now`, a safe
`dict` and `namespace`, and the tokenizer's special tokens as variables. The
text therefore equals `apply_chat_template(..., tokenize=False)` and its ids
equal `apply_chat_template(..., tokenize=True)` (golden tests).

`normalize_messages` checks a request's `messages` and refuses what the
template cannot render with a 400 `GatewayError` naming the field (`param`):
missing or empty list, unknown role, content of the wrong type, a tool
message without content, malformed tool calls. It then builds what
`transformers` would pass to the template: keys whose value is None dropped,
`developer` renamed `system` (OpenAI's newer name, which open templates do not
know), and reasoning aliased under `reasoning_content` and `thinking`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import GatewayError, invalid_request
from .tokenizer import read_tokenizer_config

Message = dict[str, Any]

ROLES = ("system", "developer", "user", "assistant", "tool")
# Names a message's reasoning arrives under; the first is what templates read.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Content-part types: text everywhere, images in user turns.
# (Other OpenAI part types, e.g. input_audio or file, are refused: open chat
# templates would silently drop them.)
TEXT_PART_TYPES = ("text",)
IMAGE_PART_TYPES = ("image_url", "image")
# Template variables the request's own fields set (not `chat_template_kwargs`).
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class ChatTemplate:
    """A compiled chat template plus the variables `transformers` passes it."""

    def __init__(self, source: str | dict[str, str], *, special_tokens: Mapping[str, str] | None = None) -> None:
        if isinstance(source, dict):
            if not source or not all(isinstance(v, str) for v in source.values()):
                raise ValueError("chat_template: named templates must map names to template strings")
        elif not isinstance(source, str) or not source:
            raise ValueError("chat_template: must be a non-empty string")
        self.source = source
        self.special_tokens: dict[str, str] = dict(special_tokens or {})

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate:
        """The template of a Hugging Face model directory (refuses one without any)."""
        root = Path(model_dir)
        config = read_tokenizer_config(root)
        # Template files take priority over the config entry, as in transformers:
        # chat_template.jinja is "default", additional_chat_templates/NAME.jinja are named.
        files: dict[str, str] = {}
        if (root / "chat_template.jinja").is_file():
            files["default"] = (root / "chat_template.jinja").read_text(encoding="utf-8")
        extra = root / "additional_chat_templates"
        if extra.is_dir():
            files.update({f.stem: f.read_text(encoding="utf-8") for f in sorted(extra.glob("*.jinja"))})
        source: str | dict[str, str] | None
        if files:
            source = files["default"] if list(files) == ["default"] else files
        else:
            source = _config_template(config.get("chat_template"))
        if not source:
            raise ValueError(f"chat_template: {root} has no chat template (chat_template.jinja or tokenizer_config.json)")
        specials = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                specials[name] = value
        return cls(source, special_tokens=specials)

    def template_for(self, *, has_tools: bool) -> str:
        if isinstance(self.source, str):
            return self.source
        if has_tools and "tool_use" in self.source:
            return self.source["tool_use"]
        if "default" in self.source:
            return self.source["default"]
        raise ValueError(f"chat_template: no 'default' among the named templates {sorted(self.source)}")

    def render(
        self,
        messages: list[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for already-normalized `messages` (see `normalize_messages`).

        A template's own `raise_exception` (or any render error) becomes a 400:
        it is the request the template refused.
        """
        compiled = compile_template(self.template_for(has_tools=tools is not None))
        extra = dict(template_kwargs or {})
        reserved = sorted(set(extra) & RESERVED_VARIABLES)
        if reserved:
            raise invalid_request(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
        variables: dict[str, Any] = {**self.special_tokens, **extra}
        try:
            return compiled.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise invalid_request(f"the chat template refused the messages: {exc}", param="messages") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise invalid_request(f"the chat template failed on the messages: {exc}", param="messages") from exc


def _config_template(value: object) -> str | dict[str, str] | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for entry in value:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str):
                named[entry["name"]] = entry["template"]
        return named or None
    return None


class _TemplateDict:
    """`dict` for templates without attribute access to the real type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace` that refuses underscore attributes (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes: {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_DICT_ATTRIBUTES = frozenset(dir(dict))
_SAFE_CACHE_SIZE = 4096  # (type, attribute name) verdicts per template; names come from the template's source


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox `transformers` uses, with two shortcuts that return what it returns:
    plain-dict fields read as items (below) and attribute verdicts remembered
    (`is_safe_attribute`).

    Templates read message fields as attributes (`message.role`); the sandbox first
    tries a real attribute, which a plain dict lacks (an AttributeError raised and
    caught, ~1 us, dozens of times per render), then the item. For a plain dict and
    a name that is no dict attribute that first try always fails, so the item (or
    the same undefined) is looked up directly."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._safe: dict[tuple[type, str], bool] = {}  # is_safe_attribute's verdicts

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        """The sandbox's verdict, remembered per (type, name): it reads only the name and
        the object's type (private names, the internal attributes of functions, frames
        and generators, the mutating methods of mutable containers), never the value.
        Half of a long conversation's render went to these checks (`str.split` and
        `loop.previtem` per message)."""
        key = (type(obj), attr)
        safe = self._safe.get(key)
        if safe is None:
            safe = super().is_safe_attribute(obj, attr, value)
            if len(self._safe) < _SAFE_CACHE_SIZE:
                self._safe[key] = safe
        return safe


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile `source` in the sandbox `transformers` uses (cached per source)."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        template = env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template: not a valid jinja template: {exc}") from exc
    # jinja layers the template's globals over the environment's in a ChainMap, which every render
    # copies key by key in Python (`runtime.new_context`); the two are final here, so one plain dict
    # holds the same names and is copied in C
    template.globals = dict(template.globals)
    return template


# -- request checks -----------------------------------------------------------


def normalize_messages(raw: object, start: int = 0) -> list[Message]:
    """Check OpenAI `messages` and return what the template sees (see module doc); with
    `start`, only `raw[start:]` (the caller holds the checked messages before it)."""
    if raw is None:
        raise invalid_request("'messages' is a required property", param="messages", code="missing_required_parameter")
    if not isinstance(raw, list):
        raise invalid_request(f"'messages' must be an array, got {_json_type(raw)}", param="messages", code="invalid_type")
    if not raw:
        raise invalid_request("'messages' must contain at least one message", param="messages", code="empty_array")
    return [_normalize_message(raw[i], i) for i in range(start, len(raw))]


def normalize_tools(raw: object) -> list[dict[str, Any]] | None:
    """Check OpenAI `tools` (function tools only); None or [] means no tools."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise invalid_request(f"'tools' must be an array, got {_json_type(raw)}", param="tools", code="invalid_type")
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(raw):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid_request(f"{param} must be an object", param=param, code="invalid_type")
        kind = tool.get("type", "function")
        if kind != "function":
            raise invalid_request(f"{param}.type must be 'function', got {kind!r}", param=f"{param}.type", code="invalid_value")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise invalid_request(f"{param}.function must be an object", param=f"{param}.function", code="invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_request(f"{param}.function.name must be a non-empty string", param=f"{param}.function.name")
        if "parameters" in fn and fn["parameters"] is not None and not isinstance(fn["parameters"], dict):
            raise invalid_request(f"{param}.function.parameters must be an object", param=f"{param}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise invalid_request(f"{param}.function.description must be a string", param=f"{param}.function.description")
        tools.append(tool)
    return tools


def _normalize_message(raw: object, i: int) -> Message:
    param = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise invalid_request(f"{param} must be an object, got {_json_type(raw)}", param=param, code="invalid_type")
    role = raw.get("role")
    if not isinstance(role, str):
        raise invalid_request(f"{param}.role is required and must be a string", param=f"{param}.role")
    if role not in ROLES:
        raise invalid_request(
            f"Invalid value {role!r} for {param}.role: supported roles are {', '.join(ROLES)}",
            param=f"{param}.role",
            code="invalid_value",
        )
    message = _drop_none(raw)
    if role == "developer":
        message["role"] = "system"
    if "name" in message and not isinstance(message["name"], str):
        raise invalid_request(f"{param}.name must be a string", param=f"{param}.name", code="invalid_type")
    content = message.get("content")
    if role in ("system", "developer"):
        _check_content(content, param, images=False, required=True)
    elif role == "user":
        _check_content(content, param, images=True, required=True)
    elif role == "tool":
        if content is None:
            raise invalid_request(f"{param}: a tool message needs 'content'", param=f"{param}.content", code="missing_required_parameter")
        _check_content(content, param, images=False, required=True)
        if "tool_call_id" in message and not isinstance(message["tool_call_id"], str):
            raise invalid_request(f"{param}.tool_call_id must be a string", param=f"{param}.tool_call_id", code="invalid_type")
    else:
        _check_assistant(message, param)
    return _alias_reasoning(message)


def _check_content(content: object, param: str, *, images: bool, required: bool) -> None:
    if content is None:
        if required:
            raise invalid_request(f"{param}.content is required", param=f"{param}.content", code="missing_required_parameter")
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise invalid_request(
            f"{param}.content must be a string or an array of content parts, got {_json_type(content)}",
            param=f"{param}.content",
            code="invalid_type",
        )
    for j, part in enumerate(content):
        _check_part(part, f"{param}.content[{j}]", images=images)


def _check_part(part: object, param: str, *, images: bool) -> None:
    if not isinstance(part, dict):
        raise invalid_request(f"{param} must be an object, got {_json_type(part)}", param=param, code="invalid_type")
    kind = part.get("type")
    if kind in TEXT_PART_TYPES:
        if not isinstance(part.get("text"), str):
            raise invalid_request(f"{param}.text must be a string", param=f"{param}.text", code="invalid_type")
        return
    if kind in IMAGE_PART_TYPES:
        if not images:
            raise invalid_request(f"{param}: image parts are only allowed in user messages", param=f"{param}.type", code="invalid_value")
        return
    allowed = TEXT_PART_TYPES + (IMAGE_PART_TYPES if images else ())
    raise invalid_request(
        f"Invalid value {kind!r} for {param}.type: supported types are {', '.join(allowed)}",
        param=f"{param}.type",
        code="invalid_value",
    )


def _check_assistant(message: Message, param: str) -> None:
    calls = message.get("tool_calls")
    _check_content(message.get("content"), param, images=False, required=False)
    for field in REASONING_FIELDS:
        if field in message and not isinstance(message[field], str):
            raise invalid_request(f"{param}.{field} must be a string", param=f"{param}.{field}", code="invalid_type")
    if calls is None:
        if "content" not in message and not any(f in message for f in REASONING_FIELDS):
            raise invalid_request(
                f"{param}: an assistant message needs 'content' or 'tool_calls'",
                param=f"{param}.content",
                code="missing_required_parameter",
            )
        return
    if not isinstance(calls, list):
        raise invalid_request(f"{param}.tool_calls must be an array", param=f"{param}.tool_calls", code="invalid_type")
    for k, call in enumerate(calls):
        cparam = f"{param}.tool_calls[{k}]"
        if not isinstance(call, dict):
            raise invalid_request(f"{cparam} must be an object", param=cparam, code="invalid_type")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise invalid_request(f"{cparam}.function must be an object", param=f"{cparam}.function", code="invalid_type")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid_request(f"{cparam}.function.name must be a non-empty string", param=f"{cparam}.function.name")
        if not isinstance(fn.get("arguments"), (str, dict)):
            raise invalid_request(
                f"{cparam}.function.arguments must be a JSON string", param=f"{cparam}.function.arguments", code="invalid_type"
            )


def _alias_reasoning(message: Message) -> Message:
    """Reasoning under every name templates read, as `transformers` fills them."""
    reasoning = next((message[f] for f in REASONING_FIELDS if message.get(f) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _drop_none(obj: dict[str, Any]) -> dict[str, Any]:
    # OpenAI clients send `content: null`, `tool_calls: null`; templates crash
    # on or print them, and transformers drops them.
    return {k: v for k, v in obj.items() if v is not None}


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


__all__ = ["ChatTemplate", "GatewayError", "compile_template", "normalize_messages", "normalize_tools"]
