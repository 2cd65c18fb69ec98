"""The gateway's chat template: same text and ids as `transformers`' apply_chat_template
on the tiny model, and OpenAI-style 400s for messages it cannot render."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kvserving.gateway.prompt.chat_template import ChatTemplate, normalize_messages, normalize_tools
from kvserving.gateway.errors import GatewayError
from kvserving.gateway.prompt.tokenizer import TextTokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "list_files",
            "description": "List files <in> a directory & more",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]

AGENT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "<think>\nI should call the tool.\n</think>\n\nChecking.",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18C and sunny"},
    {"role": "assistant", "content": "It is 18C and sunny in Paris."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "And what is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ],
    },
]

CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]] = {
    "single_user": ([{"role": "user", "content": "hello"}], None, {}),
    "agent_with_tools_reasoning_image": (AGENT, TOOLS, {}),
    "tools_without_system": ([{"role": "user", "content": "List the files."}], TOOLS, {}),
    "reasoning_content_field": (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Simple arithmetic: 4."},
            {"role": "user", "content": "and 3+3?"},
        ],
        None,
        {},
    ),
    "openai_nulls_and_parallel_tool_calls": (
        [
            {"role": "user", "content": "Weather in Paris and Rome, then list files."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                    {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "18C"},
            {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "21C"}]},
        ],
        TOOLS,
        {},
    ),
    "thinking_disabled": ([{"role": "user", "content": "Quick: capital of France?"}], None, {"enable_thinking": False}),
    "unicode": (
        [{"role": "system", "content": "Réponds en français 🇫🇷."}, {"role": "user", "content": "日本語で説明して — naïve café ✓"}],
        None,
        {},
    ),
}


def _reference_ids(hf_tokenizer: Any, messages: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any]) -> list[int]:
    out = hf_tokenizer.apply_chat_template(
        copy.deepcopy(messages), tools=copy.deepcopy(tools), add_generation_prompt=True, tokenize=True, **kwargs
    )
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return list(ids)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_text_and_ids_equal_transformers(name: str, template: ChatTemplate, tokenizer: TextTokenizer, hf_tokenizer: Any) -> None:
    messages, tools, kwargs = CONVERSATIONS[name]
    text = template.render(normalize_messages(copy.deepcopy(messages)), tools=normalize_tools(tools), template_kwargs=kwargs)
    ref_text = hf_tokenizer.apply_chat_template(
        copy.deepcopy(messages), tools=copy.deepcopy(tools), add_generation_prompt=True, tokenize=False, **kwargs
    )
    assert text == ref_text
    assert tokenizer.encode_ids(text) == _reference_ids(hf_tokenizer, messages, tools, kwargs)


def test_without_generation_prompt_equals_transformers(template: ChatTemplate, hf_tokenizer: Any) -> None:
    messages = AGENT[:5]
    text = template.render(normalize_messages(messages), tools=TOOLS, add_generation_prompt=False)
    assert text == hf_tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=False, tokenize=False)
    assert text.endswith("It is 18C and sunny in Paris.<|im_end|>\n")


def test_developer_role_renders_as_system(template: ChatTemplate, hf_tokenizer: Any) -> None:
    dev = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    sys_ = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert template.render(normalize_messages(dev)) == hf_tokenizer.apply_chat_template(sys_, add_generation_prompt=True, tokenize=False)


def test_reasoning_aliases_reach_the_template(template: ChatTemplate) -> None:
    for field in ("reasoning_content", "reasoning", "thinking"):
        messages = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", field: "because"},
            {"role": "user", "content": "q2"},
        ]
        assert "<think>\nbecause\n</think>\n\na<|im_end|>" in template.render(normalize_messages(messages))


def test_normalize_does_not_mutate_the_request() -> None:
    messages = [{"role": "developer", "content": "x", "name": None}, {"role": "user", "content": "y"}]
    before = copy.deepcopy(messages)
    normalize_messages(messages)
    assert messages == before


def test_template_from_jinja_file_and_named_templates(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": {"content": "</s>"},
                "chat_template": [
                    {"name": "default", "template": "D{% for m in messages %}[{{ m.content }}]{% endfor %}{{ eos_token }}"},
                    {"name": "tool_use", "template": "T{{ tools | length }}{{ tools[0] | tojson }}"},
                ],
            }
        )
    )
    named = ChatTemplate.from_dir(tmp_path)
    assert named.render([{"role": "user", "content": "a<b>"}]) == "D[a<b>]</s>"
    # transformers' tojson: no HTML escaping, non-ASCII kept.
    assert named.render([{"role": "user", "content": "a"}], tools=[{"n": "<é>"}]) == 'T1{"n": "<é>"}'
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0].content }}{% if add_generation_prompt %}>{% endif %}")
    assert ChatTemplate.from_dir(tmp_path).render([{"role": "user", "content": "x"}]) == "Jx>"
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("U{{ tools | length }}")
    files = ChatTemplate.from_dir(tmp_path)
    assert files.render([{"role": "user", "content": "x"}]) == "Jx>"
    # transformers picks tool_use whenever tools are passed, even an empty list.
    assert files.render([{"role": "user", "content": "x"}], tools=[]) == "U0"


def test_missing_template_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="chat_template"):
        ChatTemplate.from_dir(tmp_path)


def test_raise_exception_in_template_is_a_400() -> None:
    t = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok")
    assert t.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(GatewayError) as exc:
        t.render([{"role": "system", "content": "x"}])
    assert exc.value.status == 400
    assert exc.value.to_body()["error"]["message"] == "the chat template refused the messages: first message must be user"
    assert exc.value.param == "messages"


def test_sandbox_refuses_python_internals() -> None:
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(GatewayError) as exc:
        t.render([{"role": "user", "content": "x"}])
    assert exc.value.status == 400
    ns = ChatTemplate("{% set n = namespace(_x=1) %}{{ n._x }}")
    with pytest.raises(GatewayError):
        ns.render([{"role": "user", "content": "x"}])


def test_dict_attribute_shortcut_answers_what_the_sandbox_answers() -> None:
    """Fields read as attributes, missing ones, dict methods, keys named like methods, internals."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from kvserving.gateway.prompt.chat_template import compile_template

    source = (
        "{% for m in messages %}[{{ m.role }}|{{ m.missing is defined }}|{{ m.missing }}|{{ m.get('role') }}"
        "|{{ m.items is callable }}|{{ m['items'] }}|{{ m.keys() | list }}"
        "|{{ m.content.upper() }}|{{ m.content.split is defined }}]{% endfor %}"
    )
    messages = [{"role": "user", "content": "ab", "items": "kept as an item"}, {"role": "tool", "content": "c"}]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    assert compile_template(source).render(messages=messages) == plain.from_string(source).render(messages=messages)
    for escape in ("{{ messages[0].__class__ }}", "{{ messages[0].__init__ }}", "{{ messages[0].copy.__self__ }}"):
        assert compile_template(escape).render(messages=messages) == plain.from_string(escape).render(messages=messages)


def test_strftime_now_and_loopcontrols() -> None:
    t = ChatTemplate(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}|{{ strftime_now('%Y') | length }}"
    )
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a|4"


def test_trim_and_lstrip_blocks_like_transformers() -> None:
    t = ChatTemplate("{% for m in messages %}\n    {{ m.content }}\n{% endfor %}")
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "    a\n    b\n"


@pytest.mark.parametrize(
    ("messages", "param", "code"),
    [
        (None, "messages", "missing_required_parameter"),
        ("hi", "messages", "invalid_type"),
        ([], "messages", "empty_array"),
        (["hi"], "messages[0]", "invalid_type"),
        ([{"content": "x"}], "messages[0].role", None),
        ([{"role": "wizard", "content": "x"}], "messages[0].role", "invalid_value"),
        ([{"role": "user", "content": "x"}, {"role": "function", "content": "x"}], "messages[1].role", "invalid_value"),
        ([{"role": "user", "content": 5}], "messages[0].content", "invalid_type"),
        ([{"role": "user"}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "user", "content": None}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0].text", "invalid_type"),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "messages[0].content[0].type", "invalid_value"),
        ([{"role": "user", "content": ["bare string part"]}], "messages[0].content[0]", "invalid_type"),
        (
            [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0].type",
            "invalid_value",
        ),
        ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "a"}], "messages[1].content", "missing_required_parameter"),
        ([{"role": "user", "content": "x"}, {"role": "tool", "content": {"a": 1}}], "messages[1].content", "invalid_type"),
        ([{"role": "user", "content": "x"}, {"role": "assistant"}], "messages[1].content", "missing_required_parameter"),
        ([{"role": "assistant", "tool_calls": {"id": "a"}}], "messages[0].tool_calls", "invalid_type"),
        (
            [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"arguments": "{}"}}]}],
            "messages[0].tool_calls[0].function.name",
            None,
        ),
        (
            [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": 3}}]}],
            "messages[0].tool_calls[0].function.arguments",
            "invalid_type",
        ),
        ([{"role": "assistant", "content": "x", "reasoning_content": 1}], "messages[0].reasoning_content", "invalid_type"),
        ([{"role": "user", "content": "x", "name": 3}], "messages[0].name", "invalid_type"),
    ],
)
def test_invalid_messages_are_400_naming_the_field(messages: Any, param: str, code: str | None) -> None:
    with pytest.raises(GatewayError) as exc:
        normalize_messages(messages)
    err = exc.value
    assert (err.status, err.type, err.param, err.code) == (400, "invalid_request_error", param, code)
    assert err.to_body()["error"]["param"] == param


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ({"type": "function"}, "tools"),
        (["x"], "tools[0]"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
    ],
)
def test_invalid_tools_are_400_naming_the_field(tools: Any, param: str) -> None:
    with pytest.raises(GatewayError) as exc:
        normalize_tools(tools)
    assert (exc.value.status, exc.value.param) == (400, param)


def test_no_tools_is_none_and_valid_tools_pass_unchanged() -> None:
    assert normalize_tools(None) is None
    assert normalize_tools(TOOLS) == TOOLS


def test_assistant_with_only_tool_calls_is_valid() -> None:
    out = normalize_messages(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            }
        ]
    )
    assert "content" not in out[0]


def test_template_kwargs_cannot_replace_request_fields(template: ChatTemplate) -> None:
    with pytest.raises(GatewayError) as exc:
        template.render([{"role": "user", "content": "x"}], template_kwargs={"messages": [], "enable_thinking": True})
    assert (exc.value.status, exc.value.param) == (400, "chat_template_kwargs")
    assert exc.value.message == "chat_template_kwargs may not set messages"
    # Special tokens may be overridden, as in transformers.
    t = ChatTemplate("{{ eos_token }}", special_tokens={"eos_token": "</s>"})
    assert t.render([], template_kwargs={"eos_token": "<e>"}) == "<e>"


def test_template_files_pick_like_transformers(tiny_model_dir: Path, tmp_path: Path, tokenizer: TextTokenizer) -> None:
    from transformers import AutoTokenizer

    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text((tiny_model_dir / "tokenizer.json").read_text())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n")
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = ChatTemplate.from_dir(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    for tools in (None, TOOLS):
        ref = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        assert ours.render(normalize_messages(messages), tools=tools) == ref
        assert tokenizer.encode_ids(ref) == list(hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True)["input_ids"])
