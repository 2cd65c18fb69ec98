"""Per-token tags of chat prompts on the tiny model: golden spans and counts per
class, ids equal to transformers, turns, images, and templates that edit content."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvserving.gateway.prompt.chat_template import ChatTemplate
from kvserving.gateway.prompt.tagger import ChatTagger, TaggedPrompt, message_temporals
from kvserving.gateway.prompt.tokenizer import TextTokenizer
from kvserving.tags import NUM_TAGS, decode_tag, encode_tag

from test_chat_template import AGENT, TOOLS  # noqa: E402  (sibling test module: same conversations)

Run = tuple[str, str, str, str]


@pytest.fixture(scope="module")
def tagger(tiny_model_dir: Path, tokenizer: TextTokenizer) -> ChatTagger:
    return ChatTagger(tokenizer, ChatTemplate.from_dir(tiny_model_dir))


def runs(prompt: TaggedPrompt, tokenizer: TextTokenizer) -> list[Run]:
    """Consecutive tokens with one tag, as (temporal, modal, semantic, text)."""
    out: list[tuple[int, list[int]]] = []
    for tid, tag in zip(prompt.input_ids, prompt.tags, strict=True):
        if out and out[-1][0] == tag:
            out[-1][1].append(tid)
        else:
            out.append((tag, [tid]))
    return [(*decode_tag(tag), tokenizer.decode(ids, skip_special_tokens=False)) for tag, ids in out]


def stripped(rs: list[Run]) -> list[Run]:
    return [(t, m, s, text.strip()) for t, m, s, text in rs]


def test_agent_conversation_golden_spans(tagger: ChatTagger, tokenizer: TextTokenizer) -> None:
    prompt = tagger.build(AGENT, tools=TOOLS)
    rs = stripped(runs(prompt, tokenizer))
    system = rs[1]
    assert rs[0] == ("current", "text", "delim", "<|im_start|>system")
    # The system prompt, the template's tools prose between it and the schemas,
    # and the schemas themselves are one instruction block, always current.
    assert system[:3] == ("current", "text", "inst")
    assert system[3].startswith("You are a terse assistant.\n\n# Tools\n\nYou can call the functions below")
    assert '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city"' in system[3]
    # The template's tool-use instructions after the schemas are instruction
    # too, up to the special token that closes the system turn.
    assert system[3].endswith(
        "</tools>\n\nTo call one, reply with its name and arguments as JSON inside <tool_call></tool_call>:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    assert '"description": "List files <in> a directory & more", "parameters": {"type": "object", "properties": {}}}}' in system[3]
    assert rs[2] == ("current", "text", "delim", "<|im_end|>")
    assert rs[3:] == [
        ("turn_m1", "text", "delim", "<|im_start|>user"),
        ("turn_m1", "text", "user", "Weather in Paris?"),
        ("turn_m1", "text", "delim", "<|im_end|>\n<|im_start|>assistant\n<think>"),
        ("turn_m1", "text", "reasoning", "I should call the tool."),
        ("turn_m1", "text", "delim", "</think>"),
        ("turn_m1", "text", "assistant", "Checking."),
        ("turn_m1", "text", "delim", "<tool_call>"),
        ("turn_m1", "text", "tool_call", '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
        ("turn_m1", "text", "delim", "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>"),
        ("turn_m1", "text", "obs", "18C and sunny"),
        ("turn_m1", "text", "delim", "</tool_response><|im_end|>\n<|im_start|>assistant"),
        ("turn_m1", "text", "assistant", "It is 18C and sunny in Paris."),
        ("turn_m1", "text", "delim", "<|im_end|>"),
        ("current", "text", "delim", "<|im_start|>user"),
        ("current", "text", "user", "And what is in this picture?"),
        ("current", "image", "user", "<|vision_start|><|image_pad|><|vision_end|>"),
        ("current", "text", "delim", "<|im_end|>\n<|im_start|>assistant"),
    ]
    # Turns start at their user header.
    assert [tokenizer.decode(prompt.input_ids[k : k + 2], skip_special_tokens=False) for k in prompt.turn_starts] == [
        "<|im_start|>user"
    ] * 2
    assert prompt.current_turn_start == prompt.turn_starts[1]
    assert all(decode_tag(t)[0] == "current" for t in prompt.tags[prompt.current_turn_start :])


def test_agent_conversation_counts_per_class(tagger: ChatTagger, tokenizer: TextTokenizer) -> None:
    prompt = tagger.build(AGENT, tools=TOOLS)
    counts = Counter(decode_tag(t) for t in prompt.tags)
    enc = tokenizer.encode_ids
    # Pieces bounded by control tokens tokenize alone exactly as in the prompt.
    assert counts[("turn_m1", "text", "user")] == len(enc("Weather in Paris?"))
    assert counts[("turn_m1", "text", "obs")] == len(enc("18C and sunny"))
    assert counts[("current", "text", "user")] == len(enc("And what is in this picture?"))
    assert counts[("current", "image", "user")] == 3
    # A piece followed by a template newline may absorb it into its last token.
    assert counts[("turn_m1", "text", "reasoning")] in (len(enc("I should call the tool.")), len(enc("I should call the tool.\n")))
    assert counts[("turn_m1", "text", "assistant")] == len(enc("Checking.\n")) + len(enc("It is 18C and sunny in Paris."))
    assert sum(counts.values()) == len(prompt.input_ids)
    assert set(counts) == {
        ("current", "text", "delim"),
        ("current", "text", "inst"),
        ("current", "text", "user"),
        ("current", "image", "user"),
        ("turn_m1", "text", "delim"),
        ("turn_m1", "text", "user"),
        ("turn_m1", "text", "reasoning"),
        ("turn_m1", "text", "assistant"),
        ("turn_m1", "text", "tool_call"),
        ("turn_m1", "text", "obs"),
    }
    assert all(0 <= t < NUM_TAGS for t in prompt.tags)


def test_tagged_ids_equal_transformers(tagger: ChatTagger, hf_tokenizer: Any) -> None:
    prompt = tagger.build(copy.deepcopy(AGENT), tools=copy.deepcopy(TOOLS))
    assert prompt.method == "markers"
    ref = hf_tokenizer.apply_chat_template(copy.deepcopy(AGENT), tools=copy.deepcopy(TOOLS), add_generation_prompt=True, tokenize=True)
    assert prompt.input_ids == list(ref["input_ids"])
    assert prompt.text == hf_tokenizer.apply_chat_template(
        copy.deepcopy(AGENT), tools=copy.deepcopy(TOOLS), add_generation_prompt=True, tokenize=False
    )
    assert len(prompt.tags) == len(prompt.input_ids)


MULTI_TURN = [
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "a1"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
    {"role": "user", "content": "q3"},
    {"role": "assistant", "content": '<think>r3</think>x<tool_call>{"name": "f"}</tool_call>'},
    {"role": "user", "content": "q4"},
    {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": {"path": "/tmp", "deep": True}}}]},
    {"role": "tool", "content": "a.txt"},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
]


def test_multi_turn_golden_spans(tagger: ChatTagger, tokenizer: TextTokenizer) -> None:
    prompt = tagger.build(MULTI_TURN)
    assert stripped(runs(prompt, tokenizer)) == [
        ("older", "text", "delim", "<|im_start|>user"),
        ("older", "text", "user", "q1"),
        ("older", "text", "delim", "<|im_end|>\n<|im_start|>assistant"),
        ("older", "text", "assistant", "a1"),
        ("older", "text", "delim", "<|im_end|>\n<|im_start|>user"),
        ("older", "text", "user", "q2"),
        ("older", "text", "delim", "<|im_end|>\n<|im_start|>assistant\n<think>"),
        ("older", "text", "reasoning", "r2"),  # from reasoning_content
        ("older", "text", "delim", "</think>"),
        ("older", "text", "assistant", "a2"),
        ("older", "text", "delim", "<|im_end|>"),
        ("turn_m2", "text", "delim", "<|im_start|>user"),
        ("turn_m2", "text", "user", "q3"),
        ("turn_m2", "text", "delim", "<|im_end|>\n<|im_start|>assistant\n<think>"),
        ("turn_m2", "text", "reasoning", "r3"),  # inline <think> in the content
        ("turn_m2", "text", "delim", "</think>"),
        ("turn_m2", "text", "assistant", "x"),
        ("turn_m2", "text", "delim", "<tool_call>"),
        ("turn_m2", "text", "tool_call", '{"name": "f"}'),  # inline <tool_call> in the content
        ("turn_m2", "text", "delim", "</tool_call><|im_end|>"),
        ("turn_m1", "text", "delim", "<|im_start|>user"),
        ("turn_m1", "text", "user", "q4"),
        ("turn_m1", "text", "delim", "<|im_end|>\n<|im_start|>assistant\n<tool_call>"),
        ("turn_m1", "text", "tool_call", '{"name": "ls", "arguments": {"path": "/tmp", "deep": true}}'),  # dict arguments
        ("turn_m1", "text", "delim", "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>"),
        ("turn_m1", "text", "obs", "a.txt"),
        ("turn_m1", "text", "delim", "</tool_response><|im_end|>"),
        # An image-only user message still opens the current turn at its header.
        ("current", "text", "delim", "<|im_start|>user"),
        ("current", "image", "user", "<|vision_start|><|image_pad|><|vision_end|>"),
        ("current", "text", "delim", "<|im_end|>\n<|im_start|>assistant"),
    ]
    assert len(prompt.turn_starts) == 5
    assert [decode_tag(prompt.tags[k]) for k in prompt.turn_starts] == [
        ("older", "text", "delim"),
        ("older", "text", "delim"),
        ("turn_m2", "text", "delim"),
        ("turn_m1", "text", "delim"),
        ("current", "text", "delim"),
    ]


def test_message_temporals_count_user_turns_back() -> None:
    roles = ["system", "user", "assistant", "user", "assistant", "tool", "assistant", "user", "assistant", "tool"]
    assert message_temporals([{"role": r} for r in roles]) == [
        "current",
        "turn_m2",
        "turn_m2",
        "turn_m1",
        "turn_m1",
        "turn_m1",
        "turn_m1",
        "current",
        "current",
        "current",
    ]
    five = [{"role": "user"}] * 5
    assert message_temporals(five) == ["older", "older", "turn_m2", "turn_m1", "current"]


def test_agent_tool_loop_stays_in_the_current_turn(tagger: ChatTagger) -> None:
    loop = (
        AGENT[:2]
        + AGENT[2:4]
        + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "list_files", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c2", "content": "a.txt b.txt"},
        ]
    )
    prompt = tagger.build(loop, tools=TOOLS)
    temporals = {decode_tag(t)[0] for t in prompt.tags}
    assert temporals == {"current"}
    semantics = Counter(decode_tag(t)[2] for t in prompt.tags)
    assert semantics["tool_call"] > 0 and semantics["obs"] > 0 and semantics["user"] > 0


def test_thinking_disabled_prefill_is_template_text(tagger: ChatTagger, tokenizer: TextTokenizer) -> None:
    prompt = tagger.build([{"role": "user", "content": "hi"}], template_kwargs={"enable_thinking": False})
    assert stripped(runs(prompt, tokenizer))[-1] == ("current", "text", "delim", "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>")


def test_completion_prompt_is_current_user_text(tagger: ChatTagger, tokenizer: TextTokenizer) -> None:
    prompt = tagger.tag_text("Once upon a time<|image_pad|>")
    user, image = encode_tag("current", "text", "user"), encode_tag("current", "image", "user")
    assert prompt.input_ids == tokenizer.encode_ids("Once upon a time<|image_pad|>")
    assert prompt.tags == [user] * (len(prompt.input_ids) - 1) + [image]
    assert tagger.tag_ids([1, 2, tokenizer.token_to_id("<|image_pad|>") or -1]) == [user, user, image]


def test_marker_characters_in_the_request_are_avoided(tagger: ChatTagger, tokenizer: TextTokenizer) -> None:
    """Content that already holds the first marker alphabet gets another one; tags are unchanged."""
    odd = "private \U000f0000\U000f0002 chars"
    plain = tagger.build([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": odd}])
    rs = stripped(runs(plain, tokenizer))
    assert ("current", "text", "user", odd) in rs
    assert ("turn_m1", "text", "user", "hello") in rs


EDITING_TEMPLATE = (
    # Truncates user content and upper-cases the assistant's: the marked render
    # no longer equals the real one, so spans are re-aligned by search.
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'user' %}{{ m.content[:12] }}{% else %}{{ m.content | upper }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_that_edits_content_still_tags_sanely(tokenizer: TextTokenizer) -> None:
    tagger = ChatTagger(tokenizer, ChatTemplate(EDITING_TEMPLATE))
    messages = [
        {"role": "user", "content": "  first question here, rather long"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "short"},
    ]
    prompt = tagger.build(messages)
    assert prompt.method == "aligned"
    assert prompt.input_ids == tokenizer.encode_ids(prompt.text)
    assert len(prompt.tags) == len(prompt.input_ids)
    rs = stripped(runs(prompt, tokenizer))
    assert ("turn_m1", "text", "assistant", "AN ANSWER") in rs
    assert ("current", "text", "user", "short") in rs
    assert rs[-1] == ("current", "text", "delim", "<|im_end|>\n<|im_start|>assistant")


TOOLS_AS_JSON_TEMPLATE = (
    # Another layout: tools after the conversation, tool calls dumped whole with tojson.
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}<tool_call>{{ m.tool_calls | tojson }}</tool_call>{% endif %}<|im_end|>\n{% endfor %}"
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_other_template_layout(tokenizer: TextTokenizer) -> None:
    tagger = ChatTagger(tokenizer, ChatTemplate(TOOLS_AS_JSON_TEMPLATE))
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"p": 1}'}}]},
        {"role": "tool", "content": "ok"},
    ]
    prompt = tagger.build(messages, tools=TOOLS[:1])
    rs = stripped(runs(prompt, tokenizer))
    call = next(r for r in rs if r[2] == "tool_call")
    # The JSON glue around and between the call's name and arguments belongs to the call.
    assert call[3] == '[{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{\\"p\\": 1}"}}]'
    assert rs[rs.index(call) - 1][2:] == ("delim", "<|im_end|>\n<|im_start|>assistant\n<tool_call>")
    inst = next(r for r in rs if r[2] == "inst")
    assert inst[0] == "current" and "get_weather" in inst[3] and "Current weather in a city" in inst[3]
    assert ("current", "text", "obs", "ok") in rs


def test_generation_prompt_is_current_when_the_last_user_message_renders_empty(tokenizer: TextTokenizer) -> None:
    """A template that renders only string content drops a list-content user
    message's text: the empty message still opens the current turn at its
    header, and the generation prompt (with its `<think>` markup) is current."""
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
    )
    tagger = ChatTagger(tokenizer, ChatTemplate(template))
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": [{"type": "text", "text": "dropped by this template"}]},
    ]
    rs = stripped(runs(tagger.build(messages), tokenizer))
    prompt = tagger.build(messages)
    assert rs[-2:] == [
        ("turn_m1", "text", "delim", "<|im_end|>"),
        ("current", "text", "delim", "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>"),
    ]
    assert tokenizer.decode(prompt.input_ids[prompt.current_turn_start :][:2], skip_special_tokens=False) == "<|im_start|>user"


def test_image_runs_that_do_not_match_the_parts_keep_their_text_roles(tokenizer: TextTokenizer) -> None:
    """A template that writes two placeholders per image: counts disagree, so
    image tokens keep the tag of where they sit, with the image modality."""
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}"
        "{% else %}<|image_pad|> <|image_pad|>{% endif %}{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    )
    tagger = ChatTagger(tokenizer, ChatTemplate(template))
    prompt = tagger.build(
        [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}]}]
    )
    pad = tokenizer.token_to_id("<|image_pad|>")
    image_tags = {decode_tag(t) for i, t in zip(prompt.input_ids, prompt.tags, strict=True) if i == pad}
    assert image_tags and all(m == "image" for _, m, _ in image_tags)
    assert ("current", "text", "user", "see") in stripped(runs(prompt, tokenizer))


def test_template_that_refuses_marked_content_falls_back_to_coarse_tags(tokenizer: TextTokenizer) -> None:
    """The marked render must never turn a valid request into an error."""
    template = (
        "{% for m in messages %}{% if m.content | length > 12 %}{{ raise_exception('too long') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    )
    tagger = ChatTagger(tokenizer, ChatTemplate(template))
    prompt = tagger.build([{"role": "user", "content": "twelve chars"}])
    assert prompt.method == "coarse"
    # (jinja drops the template's one trailing newline, as in transformers)
    assert prompt.input_ids == tokenizer.encode_ids("<|im_start|>user\ntwelve chars<|im_end|>\n<|im_start|>assistant")
    assert stripped(runs(prompt, tokenizer)) == [
        ("current", "text", "delim", "<|im_start|>"),
        ("current", "text", "user", "user\ntwelve chars"),
        ("current", "text", "delim", "<|im_end|>"),
        ("current", "text", "user", ""),
        ("current", "text", "delim", "<|im_start|>"),
        ("current", "text", "user", "assistant"),
    ]


# -- property: random conversations ---------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TEXT = st.text(alphabet=st.sampled_from(list("ab xyz,.!?\n\t{}\"'é日本😀-_/")), min_size=0, max_size=24)


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXT)})
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            parts: list[dict[str, Any]] = [{"type": "text", "text": draw(TEXT)}]
            if draw(st.booleans()):
                parts.insert(draw(st.integers(0, 1)), {"type": "image_url", "image_url": {"url": "data:x"}})
            messages.append({"role": "user", "content": parts})
        else:
            messages.append({"role": "user", "content": draw(TEXT)})
        if draw(st.booleans()):
            content = draw(TEXT)
            if draw(st.booleans()):
                content = f"<think>{draw(TEXT)}</think>{content}"
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if draw(st.booleans()):
                msg["tool_calls"] = [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"q": "' + draw(TEXT).replace('"', "").replace("\\", "") + '"}'},
                    }
                ]
                messages.append(msg)
                messages.append({"role": "tool", "tool_call_id": "c", "content": draw(TEXT)})
            else:
                messages.append(msg)
    return messages


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations(), with_tools=st.booleans())
def test_random_conversations_keep_ids_and_tag_every_piece(
    messages: list[dict[str, Any]], with_tools: bool, tagger: ChatTagger, tokenizer: TextTokenizer, hf_tokenizer: Any
) -> None:
    tools = TOOLS if with_tools else None
    prompt = tagger.build(copy.deepcopy(messages), tools=copy.deepcopy(tools))
    ref = hf_tokenizer.apply_chat_template(copy.deepcopy(messages), tools=copy.deepcopy(tools), add_generation_prompt=True, tokenize=True)
    assert prompt.input_ids == list(ref["input_ids"])
    assert len(prompt.tags) == len(prompt.input_ids) and prompt.method == "markers"
    rs = runs(prompt, tokenizer)
    # Everything from the current turn's header on is current.
    assert all(decode_tag(t)[0] == "current" for t in prompt.tags[prompt.current_turn_start :])
    # The inside of every piece carries its role (its first and last character
    # may share a token with template text).
    for m in messages:
        role, content = m["role"], m["content"]
        pieces: list[tuple[str, str]] = []
        if role == "user":
            texts = [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]
            pieces += [("user", t) for t in texts]
        elif role == "tool":
            pieces.append(("obs", content))
        elif role == "system":
            pieces.append(("inst", content))
        else:
            reasoning, _, answer = content.rpartition("</think>")
            pieces += [("reasoning", reasoning.removeprefix("<think>")), ("assistant", answer)]
            pieces += [("tool_call", c["function"]["arguments"]) for c in m.get("tool_calls", [])]
        for semantic, t in pieces:
            core = t.strip()[1:-1]
            if core.strip():
                assert any(core in text for _, _, s, text in rs if s == semantic), (semantic, core, rs)
    # One image run per image part, tagged user image.
    images = sum(1 for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image_url")
    assert sum(1 for _, mod, s, _ in rs if mod == "image" and s == "user") == images
    assert len(prompt.turn_starts) == sum(1 for m in messages if m["role"] == "user")


def test_a_turns_prompt_keeps_its_roles_in_the_next_turn(tagger: ChatTagger) -> None:
    """Turn N's prompt is a prefix of turn N+1's (this template keeps every
    turn), and its tokens keep their modality and role there; only the
    temporal part ages. Prefix-cache hashes cover modality and role, so this
    is what lets the next turn reuse the pages."""
    per_turn = 2 * 7
    conversation = copy.deepcopy(AGENT[:2])
    steps: list[dict[str, Any]] = [
        AGENT[2],
        AGENT[3],
        AGENT[4],
        AGENT[5],
        {"role": "assistant", "content": "<think>\nAn image.\n</think>\n\nA cat."},
        {"role": "user", "content": "thanks"},
    ]
    previous = tagger.build(conversation, tools=TOOLS)
    for message in steps:
        conversation.append(copy.deepcopy(message))
        if message["role"] == "assistant":
            continue  # a prompt never ends on an assistant message
        current = tagger.build(conversation, tools=TOOLS)
        n = len(previous.input_ids)
        assert current.input_ids[:n] == previous.input_ids
        assert [t % per_turn for t in current.tags[:n]] == [t % per_turn for t in previous.tags]
        previous = current


def test_a_system_message_later_in_the_conversation_is_its_own_block(tagger: ChatTagger, tokenizer: TextTokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "system", "content": "Reminder: cite files."},
        {"role": "user", "content": "q2"},
    ]
    rs = stripped(runs(tagger.build(messages), tokenizer))
    # Each system message is instruction; the turn markup between two of them is not.
    assert rs[:5] == [
        ("current", "text", "delim", "<|im_start|>system"),
        ("current", "text", "inst", "Be brief."),
        ("current", "text", "delim", "<|im_end|>\n<|im_start|>system"),
        ("current", "text", "inst", "Answer in English."),
        ("current", "text", "delim", "<|im_end|>"),
    ]
    assert ("current", "text", "inst", "Reminder: cite files.") in rs
    assert ("turn_m1", "text", "assistant", "a1") in rs
