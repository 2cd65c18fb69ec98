"""Appended renders (turn_render.py): a prompt marked only in the turn its request
appends to a kept render gets exactly the prompt a whole render gets, on
interleaved multi-turn agent conversations and templates that strip earlier
reasoning, number or alternate messages, render tools after the conversation
or edit content; a template the short list would misrender is caught before
its tags are used; bad new messages get the whole path's 400."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
from test_token_prefixes import EMPTY_LIST_TEMPLATE, STRIPPING_TEMPLATE, TOOLS, text_turns

from kept import build, kept_tagger, store_of

from kvserving.gateway.conversations import Conversations
from kvserving.gateway.prompt.chat_template import ChatTemplate
from kvserving.gateway.errors import GatewayError
from kvserving.gateway.prompt.tagger import ChatTagger
from kvserving.gateway.prompt.tokenizer import TextTokenizer
from kvserving.gateway.prompt.turn_render import TurnRenders

# Marks every message by the parity of its index (templates that check alternating
# roles by loop.index0): the short list keeps each message's parity.
PARITY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}{% if loop.index0 % 2 %} odd{% endif %}\n"
    "{% if m.content is string %}{{ m.content }}{% endif %}"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Numbers the messages: the short list would number them differently, which the
# header check must catch (no appended render, never a wrong one).
NUMBERED_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }} {{ loop.index }}\n"
    "{% if m.content is string %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _template(name: str, tiny: ChatTemplate) -> ChatTemplate:
    from test_tagger import EDITING_TEMPLATE, TOOLS_AS_JSON_TEMPLATE

    sources = {
        "tools_after": TOOLS_AS_JSON_TEMPLATE,
        "empty_list": EMPTY_LIST_TEMPLATE,
        "stripping": STRIPPING_TEMPLATE,
        "editing": EDITING_TEMPLATE,
        "parity": PARITY_TEMPLATE,
        "numbered": NUMBERED_TEMPLATE,
    }
    return tiny if name == "tiny" else ChatTemplate(sources[name])


@pytest.mark.parametrize("name", ["tiny", "stripping", "parity", "empty_list", "tools_after", "editing", "numbered"])
def test_appended_renders_tag_as_whole_ones(name: str, tokenizer: TextTokenizer, template: ChatTemplate) -> None:
    """Every turn of interleaved conversations: the prompt of a tagger that appends to kept
    renders equals the prompt of one that renders every request whole, and a tagging from
    scratch; an appended render is refused exactly where the whole marked render is not
    the real one either (content the template edits)."""
    chosen = _template(name, template)
    full = ChatTagger(tokenizer, chosen)
    whole = kept_tagger(tokenizer, chosen)
    appending = kept_tagger(tokenizer, chosen, renders=True)
    renders = appending.renders
    assert renders is not None
    rng = random.Random(5)
    sessions = [(text_turns(rng, rng.randint(3, 8)), TOOLS if rng.random() < 0.5 else None) for _ in range(8)]
    requests = appended = 0
    while any(t for t, _ in sessions):
        for sid, (t, tools) in enumerate(sessions):
            if not t:
                continue
            messages = t.pop(0)
            hits, mismatches = renders.hits, renders.mismatches
            expected = build(whole, copy.deepcopy(messages), tools=copy.deepcopy(tools), key=f"s{sid}")
            got = build(appending, copy.deepcopy(messages), tools=copy.deepcopy(tools), key=f"s{sid}")
            assert got == expected == full.build(copy.deepcopy(messages), tools=copy.deepcopy(tools))
            if renders.mismatches > mismatches:
                assert expected.method == "aligned"  # appending adds no mismatch of its own
            appended += renders.hits - hits
            requests += 1
    assert renders.hits == appended and renders.hits + renders.misses == requests
    assert renders.checks == appended + renders.mismatches
    if name == "numbered":
        assert appended == 0  # the short list numbers its messages differently: caught before use
    elif name == "editing":
        # user text cut at 12 characters, markers included: the marked render is not the real
        # one with markers (tags aligned), and such a render is not kept to append to
        assert appended == 0 and renders.mismatches == 0
    elif name == "tools_after":
        # tools rendered after the conversation: only tool-less conversations append
        assert 0 < appended < requests // 2, (appended, requests)
    elif name == "tiny":
        # requests render whole when there is no kept render (a conversation's first) or its last
        # user message is its first (the short list would be the whole list): 24 of these 71
        assert appended >= requests // 2, (appended, requests)
    else:
        # these templates render a user message's list content as nothing or as its repr:
        # such a message u has no marker to align on, and its requests render whole
        assert appended >= requests // 4, (appended, requests)


def _conversation(turns: int) -> list[list[dict[str, Any]]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}]
    out = []
    for k in range(turns):
        messages = [*messages, {"role": "user", "content": f"step {k}: run the tests"}]
        out.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"ran step {k}", "reasoning_content": "think"}]
    return out


def test_a_long_conversation_renders_only_its_last_turn(tokenizer: TextTokenizer, template: ChatTemplate) -> None:
    tagger = kept_tagger(tokenizer, template, renders=True)
    renders, store = tagger.renders, store_of(tagger)
    assert renders is not None
    full = ChatTagger(tokenizer, template)
    rendered: list[int] = []
    original = template.render

    def counting(messages: list[Any], **kwargs: Any) -> str:
        rendered.append(len(messages))
        return original(messages, **kwargs)

    tagger.template = type("T", (), {"render": staticmethod(counting)})()  # type: ignore[assignment]
    for k, messages in enumerate(_conversation(12)):
        rendered.clear()
        hits = renders.hits
        got = build(tagger, copy.deepcopy(messages))
        assert got == full.build(copy.deepcopy(messages))
        assert renders.hits - hits == (k >= 2)
        if k >= 3:
            # the short list with markers (system + the last turn's user, assistant, new user), the real render whole
            assert rendered == [4, len(messages)], rendered
    # the conversation's record holds its last render, the only one kept
    assert renders.hits == 10 and renders.misses == 2 and sum(len(b) for b in store._renders.values()) == 1
    c = store.get("c")
    assert c is not None and c.render is not None and c.render.raw == _conversation(12)[-1]


def test_an_edited_history_renders_whole(tokenizer: TextTokenizer, template: ChatTemplate) -> None:
    tagger = kept_tagger(tokenizer, template, renders=True)
    renders = tagger.renders
    assert renders is not None
    turns = _conversation(5)
    for messages in turns[:4]:
        build(tagger, copy.deepcopy(messages))
    hits = renders.hits
    edited = copy.deepcopy(turns[4])
    edited[2]["content"] = "something else"  # the client rewrote an earlier assistant reply
    got = build(tagger, edited)
    assert renders.hits == hits
    assert got == ChatTagger(tokenizer, template).build(copy.deepcopy(edited))


def test_a_bad_new_message_gets_the_whole_paths_error(tokenizer: TextTokenizer, template: ChatTemplate) -> None:
    tagger = kept_tagger(tokenizer, template, renders=True)
    turns = _conversation(4)
    for messages in turns:
        build(tagger, copy.deepcopy(messages))
    bad = [*copy.deepcopy(turns[-1]), {"role": "assistant", "content": "x"}, {"role": "wizard", "content": "y"}]
    assert tagger.renders is not None and tagger.renders.find(bad, None, (True, None)) is not None  # the appending path is taken
    with pytest.raises(GatewayError) as appended:
        tagger.build(copy.deepcopy(bad))
    with pytest.raises(GatewayError) as whole:
        ChatTagger(tokenizer, template).build(copy.deepcopy(bad))
    assert appended.value.to_body() == whole.value.to_body()
    assert appended.value.param == f"messages[{len(bad) - 1}].role"


def test_kept_renders_go_with_their_conversation_records(tokenizer: TextTokenizer, template: ChatTemplate) -> None:
    store = Conversations(max_conversations=3)
    tagger = kept_tagger(tokenizer, template, prefixes=False, renders=True, store=store)
    sessions = [[[{"role": "system", "content": f"agent {s}"}, *m[1:]] for m in _conversation(4)] for s in range(5)]
    for step in range(4):
        for sid, s in enumerate(sessions):
            build(tagger, copy.deepcopy(s[step]), key=f"s{sid}")
        # one per conversation (its new render replaced the one it extended), least recently used out
        assert [c.key for c in store] == ["s2", "s3", "s4"]
        assert sorted(id(k) for b in store._renders.values() for k in b) == sorted(id(c.render) for c in store)
    # a record is charged its marked render's characters / 4; the budget evicts the least recently used
    charged = store.tokens
    assert charged == sum(len(c.render.marked) // 4 for c in store if c.render is not None)
    small = Conversations(max_tokens=charged // 3)
    tagger = kept_tagger(tokenizer, template, prefixes=False, renders=True, store=small)
    for sid, s in enumerate(sessions):
        build(tagger, copy.deepcopy(s[3]), key=f"s{sid}")
    assert small.tokens <= charged // 3 and [c.key for c in small][-1] == "s4"


def test_appending_stops_when_its_renders_keep_mismatching() -> None:
    renders = TurnRenders(Conversations())
    for _ in range(8):
        renders.checked(False)
    assert renders.on  # eight odd requests leave it on
    for _ in range(100):
        renders.checked(True)
    renders.checked(False)
    assert renders.on  # 9 of 109: under a tenth
    for _ in range(4):
        renders.checked(False)
    assert not renders.on and renders.find([{"role": "user", "content": "x"}, {}], None, (True, None)) is None


def test_conversations_that_share_a_key_are_told_apart_and_bounded(tokenizer: TextTokenizer, template: ChatTemplate) -> None:
    """Twelve conversations with the same system prompt, first user message and last message
    but different replies in between share one key: a request finds its own kept render
    among the eight most recent; older ones are dropped (a lookup compares at most a bucket)."""
    tagger = kept_tagger(tokenizer, template, prefixes=False, renders=True)
    renders, store = tagger.renders, store_of(tagger)
    assert renders is not None
    convs = []
    for c in range(12):
        m = [
            {"role": "system", "content": "agent"},
            {"role": "user", "content": "fix the bug"},
            {"role": "assistant", "content": f"looked at file {c}"},
            {"role": "user", "content": "continue"},
        ]
        build(tagger, copy.deepcopy(m), key=f"c{c}")
        convs.append(m)
    assert [len(b) for b in store._renders.values()] == [8]  # one key, eight in its bucket
    for c, m in enumerate(convs):
        nxt = [*m, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "continue"}]
        found = renders.find(nxt, None, (True, None))
        if c < 4:
            assert found is None  # dropped from the bucket: renders whole
        else:
            assert found is not None and found.raw == m


def test_kept_renders_are_found_only_by_their_own_scope(tokenizer: TextTokenizer, template: ChatTemplate) -> None:
    tagger = kept_tagger(tokenizer, template, prefixes=False, renders=True)
    renders = tagger.renders
    assert renders is not None
    turns = _conversation(4)
    for messages in turns[:3]:
        build(tagger, copy.deepcopy(messages), scope="a", key="a")
    hits = renders.hits
    for scope in ("b", ""):
        build(tagger, copy.deepcopy(turns[3]), scope=scope, key=f"{scope}-c")
    assert renders.hits == hits
    build(tagger, copy.deepcopy(turns[3]), scope="a", key="a")
    assert renders.hits == hits + 1


# Prefixes a user message that starts with "!" (it inspects content: the marked message
# starts with its marker, so the marked render never shows the prefix).
LOUD_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content.startswith('!') %}LOUD {% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_an_appended_render_that_is_not_the_real_one_is_refused(tokenizer: TextTokenizer) -> None:
    """The third turn appends a message the template inspects: its appended render is compared
    with the real one, refused and counted, and the prompt is what a tagger without kept
    renders gives (the whole marked render, tags aligned to the real text)."""
    chosen = ChatTemplate(LOUD_TEMPLATE)
    tagger = kept_tagger(tokenizer, chosen, renders=True)
    renders = tagger.renders
    assert renders is not None
    turns = _conversation(3)
    for messages in turns[:2]:
        assert build(tagger, copy.deepcopy(messages)).method == "markers"
    loud = [*turns[2][:-1], {"role": "user", "content": "!stop the run"}]
    got = build(tagger, copy.deepcopy(loud))
    assert (renders.checks, renders.mismatches, renders.hits) == (1, 1, 0)
    assert got == ChatTagger(tokenizer, chosen).build(copy.deepcopy(loud))
    assert got.method == "aligned" and "LOUD !stop the run" in got.text
