"""Incremental tokenization (token_prefixes.py): a turn that reuses the previous
turn's kept ids and tokenizes only its new text gets exactly the prompt of the
full path — text, ids, tags, turn starts, method and character starts — on
multi-turn agent conversations with tools, reasoning and images, on templates
that keep or strip earlier turns; and the kept prefixes stay within bounds."""

from __future__ import annotations

import copy
import json
import random
from collections import Counter
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer

from kept import build, encode, kept_tagger, store_of

from kvserving.gateway.conversations import Conversations
from kvserving.gateway.prompt.chat_template import ChatTemplate
from kvserving.gateway.prompt.tagger import ChatTagger
from kvserving.gateway.prompt.token_prefixes import TokenPrefixes
from kvserving.gateway.prompt.tokenizer import TextTokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}}},
        },
    },
]

# Qwen3-style: reasoning of assistant turns before the last user message is dropped,
# so an earlier prompt (which showed it) is no prefix of the next one.
STRIPPING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<|im_start|>assistant\n"
    "{%- if loop.index0 > ns.last_user and m.reasoning_content -%}<think>\n{{ m.reasoning_content }}\n</think>\n\n{%- endif -%}"
    "{{ m.content or '' }}<|im_end|>\n"
    "{%- else -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)

WORDS = ["open", "the", "file", "é", "日本", "😀", "run", "tests", "  ", "\n", "\n\n", "x=1;", "\u0338", "<", ">", "'s", "42"]


def words(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(n))


def agent_turns(rng: random.Random, turns: int) -> list[list[dict[str, Any]]]:
    """The messages of each turn of a random agent conversation: user text and images,
    assistant replies with reasoning (inline or as a field) and tool calls, tool results."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent. " + words(rng, 8)}]
    out = []
    for _ in range(turns):
        if rng.random() < 0.3:
            messages.append(
                {
                    "role": "user",
                    "content": [{"type": "text", "text": words(rng, 6)}, {"type": "image_url", "image_url": {"url": "data:x"}}],
                }
            )
        else:
            messages.append({"role": "user", "content": words(rng, rng.randint(1, 12))})
        out.append(copy.deepcopy(messages))
        reply: dict[str, Any] = {"role": "assistant", "content": words(rng, rng.randint(0, 8))}
        kind = rng.random()
        if kind < 0.3:
            reply["content"] = f"<think>\n{words(rng, 5)}\n</think>\n\n{reply['content']}"
        elif kind < 0.5:
            reply["reasoning_content"] = words(rng, 5)
        if rng.random() < 0.5:
            reply["tool_calls"] = [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "run_tests", "arguments": '{"path": "t/' + str(rng.randint(0, 9)) + '"}'},
                }
            ]
            messages.append(reply)
            messages.append({"role": "tool", "tool_call_id": "c1", "content": words(rng, rng.randint(1, 10))})
            out.append(copy.deepcopy(messages))  # the agent's next request within the turn
            messages.append({"role": "assistant", "content": words(rng, 4)})
        else:
            messages.append(reply)
    return out


def test_incremental_prompts_equal_the_full_path(tokenizer: TextTokenizer, template: ChatTemplate) -> None:
    full = ChatTagger(tokenizer, template)
    incremental = kept_tagger(tokenizer, template)
    prefixes = incremental.prefixes
    assert prefixes is not None
    rng = random.Random(7)
    requests = 0
    for conversation in range(12):
        tools = TOOLS if rng.random() < 0.5 else None
        for messages in agent_turns(rng, rng.randint(2, 6)):
            expected = full.build(copy.deepcopy(messages), tools=copy.deepcopy(tools))
            got = build(incremental, copy.deepcopy(messages), tools=copy.deepcopy(tools), key=f"c{conversation}")
            assert got == expected
            assert got.input_ids == tokenizer.encode_ids(got.text)
            assert json.loads(f"[{got.ids_json}]") == got.input_ids  # the ids' JSON, kept prefix + new ids
            requests += 1
    # Every request after a conversation's first one reused a kept prefix.
    assert prefixes.hits >= requests - 12 and prefixes.misses == 12


def test_sessions_interleaved_each_reuse_their_own_prefix(tokenizer: TextTokenizer, template: ChatTemplate) -> None:
    full = ChatTagger(tokenizer, template)
    incremental = kept_tagger(tokenizer, template)
    prefixes, store = incremental.prefixes, store_of(incremental)
    assert prefixes is not None
    rng = random.Random(3)
    sessions = [agent_turns(rng, 4) for _ in range(5)]
    for step in range(max(len(s) for s in sessions)):
        for sid, s in enumerate(sessions):
            if step < len(s):
                got = build(incremental, copy.deepcopy(s[step]), tools=TOOLS, key=f"s{sid}")
                assert got == full.build(copy.deepcopy(s[step]), tools=TOOLS)
    assert prefixes.misses == len(sessions)  # each system prompt differs: no shared first message
    # one entry per conversation (each turn's replaced the one it extended) and one per first message
    assert [len(c.prefixes) for c in store] == [2] * len(sessions)
    assert len(store._prefixes) == 2 * len(sessions)
    assert sum(e.shared for e in store._prefixes.values()) == len(sessions)


def test_sessions_that_differ_only_far_before_each_cut_keep_their_own_prefix(
    tokenizer: TextTokenizer,
    template: ChatTemplate,
) -> None:
    """Agents share a system prompt and boilerplate: the text just before each cut is the same in
    every session (only a session number far before it differs); each still hits its own entry."""
    full = ChatTagger(tokenizer, template)
    incremental = kept_tagger(tokenizer, template)
    prefixes, store = incremental.prefixes, store_of(incremental)
    assert prefixes is not None
    system = {"role": "system", "content": "You are a coding agent. Use the tools. " * 4}
    tail = ": open the next file, run the tests and tell me what failed, then read the parser module."
    reply = "I ran the tests; two failed in test_parser.py. Next I will read it and fix the parser module."
    histories: list[list[dict[str, Any]]] = [[system] for _ in range(6)]
    for step in range(4):
        for sid, history in enumerate(histories):
            history.append({"role": "user", "content": f"Session {sid}, step {step}{tail}"})
            got = build(incremental, copy.deepcopy(history), key=f"s{sid}")
            assert got == full.build(copy.deepcopy(history))
            history.append({"role": "assistant", "content": reply})
    # the first conversation tokenized its whole first prompt; the others only what follows the
    # shared system prompt, then every later turn only its new text
    assert prefixes.misses == 1 and prefixes.hits == 4 * len(histories) - 1
    assert len(store._prefixes) == len(histories) + 1


def test_new_conversations_sharing_a_system_prompt_and_tools_reuse_its_tokens(
    tokenizer: TextTokenizer,
    template: ChatTemplate,
) -> None:
    full = ChatTagger(tokenizer, template)
    incremental = kept_tagger(tokenizer, template)
    prefixes, store = incremental.prefixes, store_of(incremental)
    assert prefixes is not None
    system = {"role": "system", "content": "You are a coding agent in a large repository. " * 8}
    rng = random.Random(11)
    for n in range(6):
        messages = [system, {"role": "user", "content": words(rng, 12)}]
        if n % 2:
            messages += [{"role": "assistant", "content": words(rng, 5)}, {"role": "user", "content": words(rng, 4)}]
        got = build(incremental, copy.deepcopy(messages), tools=TOOLS, key=f"c{n}")
        assert got == full.build(copy.deepcopy(messages), tools=TOOLS)
    assert prefixes.misses == 1 and prefixes.hits == 5
    # their labels and the marked render's parse of the shared block came from the kept prefix too
    assert incremental.label_hits == 5 and incremental.parse_hits == 5
    shared = [e for e in store._prefixes.values() if e.shared]
    assert len(shared) == 1 and len(shared[0].ids) > 100  # the system prompt and the tool schemas
    # a different system prompt is a new shared entry, not a wrong hit
    other = [{"role": "system", "content": "You are a reviewer. " * 8}, {"role": "user", "content": "hi"}]
    assert build(incremental, copy.deepcopy(other), tools=TOOLS, key="other") == full.build(copy.deepcopy(other), tools=TOOLS)
    assert prefixes.misses == 2


def test_template_that_strips_earlier_reasoning_falls_back_to_the_full_path(tokenizer: TextTokenizer) -> None:
    template = ChatTemplate(STRIPPING_TEMPLATE)
    full = ChatTagger(tokenizer, template)
    incremental = kept_tagger(tokenizer, template)
    prefixes = incremental.prefixes
    assert prefixes is not None
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q1"}]
    assert build(incremental, copy.deepcopy(messages)) == full.build(copy.deepcopy(messages))
    messages.append({"role": "assistant", "content": "a1", "reasoning_content": "think 1"})
    messages.append({"role": "tool", "content": "result"})  # still within the turn: reasoning shown
    assert build(incremental, copy.deepcopy(messages)) == full.build(copy.deepcopy(messages))
    assert prefixes.hits == 1
    messages.append({"role": "user", "content": "q2"})  # the reasoning is gone: the kept text no longer matches
    first = full.build(copy.deepcopy(messages))
    assert "think 1" not in first.text
    assert build(incremental, copy.deepcopy(messages)) == first
    # The kept prefix ends at the previous prompt's generation prompt; what still matches
    # is only the system block: its shared entry serves.
    assert prefixes.hits == 2 and prefixes.misses == 1


def test_encode_equals_full_tokenization_on_growing_texts(tokenizer: TextTokenizer) -> None:
    """Random text with special tokens (and whitespace, combining marks, `<`/`>`
    around them) grown piece by piece: every encode equals the full one."""
    prefixes = TokenPrefixes(tokenizer, Conversations())
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<|image_pad|>"]
    rng = random.Random(11)
    for n in range(20):
        text = ""
        for _ in range(8):
            text += "".join(rng.choice(specials) if rng.random() < 0.3 else words(rng, 2) for _ in range(rng.randint(1, 12)))
            enc = encode(prefixes, text, key=f"c{n}")
            ref = tokenizer.encode(text)
            assert (enc.ids, enc.offsets()) == (ref.ids, ref.offsets)
            assert (prefixes.encode(text).ids, prefixes.encode(text).offsets) == (ref.ids, ref.offsets)
    assert prefixes.hits > 50


def test_kept_prefixes_go_with_their_conversation_records(tokenizer: TextTokenizer) -> None:
    store = Conversations(max_conversations=3)
    prefixes = TokenPrefixes(tokenizer, store)
    for i in range(6):
        encode(prefixes, f"<|im_start|>user\nsession {i} asks a question<|im_end|>\n<|im_start|>assistant\n", key=f"s{i}")
    # the three most recent conversations' records: each its prompt's prefix and its first message's (shared)
    assert [c.key for c in store] == ["s3", "s4", "s5"] and len(store._prefixes) == 6
    assert encode(prefixes, "<|im_start|>user\nsession 5 asks a question<|im_end|>\n<|im_start|>assistant\nok", key="s5")
    assert prefixes.hits == 1
    assert encode(prefixes, "<|im_start|>user\nsession 0 asks a question<|im_end|>\n<|im_start|>assistant\nok", key="s0")
    assert prefixes.hits == 1  # evicted with its record
    # the count of entries per cut position (lookups hash only where an entry is) follows every
    # eviction and replacement
    assert sum(store._cuts.values()) == len(store._prefixes) == 6
    assert store._cuts == Counter(e.cut for e in store._prefixes.values())
    assert prefixes.tokens == sum(len(e.ids) for c in store for e in c.prefixes)
    small = Conversations(max_tokens=20)
    budgeted = TokenPrefixes(tokenizer, small)
    for key in ("a", "b"):
        encode(budgeted, f"<|im_start|>user\n{key} " + "word " * 40 + "<|im_end|>\n<|im_start|>assistant\n", key=key)
    # one prompt over the budget: only the conversation just filed stays (its next turn needs it)
    # (a record is charged its longest form: the prompt's prefix, which its first message's is a prefix of)
    b = small.get("b")
    assert [c.key for c in small] == ["b"] and b is not None and small.tokens == max(len(e.ids) for e in b.prefixes) > 20


def test_tokens_that_look_outside_their_match_are_never_cut_at() -> None:
    """An lstrip special token's match reaches the whitespace before it, a
    truncating tokenizer cuts the whole text: neither may be split."""
    from tokenizers import models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<s>", lstrip=True, special=True), AddedToken("</s>", special=True)])
    prefixes = TokenPrefixes(TextTokenizer(tok), Conversations())
    assert prefixes.enabled and prefixes._cut_ids == frozenset({tok.token_to_id("</s>")})
    for text in ("a </s> b <s> a", "a </s> b <s> a </s> b   <s>", "a </s> b <s> a </s> b   <s> a </s>  b"):
        enc, ref = encode(prefixes, text), tok.encode(text, add_special_tokens=False)
        assert (enc.ids, enc.offsets()) == (ref.ids, ref.offsets)
    tok.enable_truncation(4)
    assert not TokenPrefixes(TextTokenizer(tok), Conversations()).enabled


@pytest.mark.parametrize("scheme", ["prepend_normalizer", "first", "always"])
def test_sentencepiece_style_tokenizers_split_exactly_too(scheme: str) -> None:
    """Llama-2 style (a normalizer prepends "▁" to every stretch) and Metaspace
    (Mistral, Gemma: "▁" before the first stretch or every one): the stretch
    after a cut is treated as in the whole text."""
    from tokenizers import normalizers, pre_tokenizers, trainers
    from tokenizers import models as tok_models

    tok = Tokenizer(tok_models.BPE(unk_token="<unk>"))
    if scheme == "prepend_normalizer":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    corpus = ["open the file and run the tests", "the answer is 42, é 日本", "hello world, hello agent"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]))
    prefixes = TokenPrefixes(TextTokenizer(tok), Conversations())
    pieces = ["open", "the", " file", "  ", "é", "日本", "\n", "hello", "[INST]", "[/INST]", "</s>", "<s>", " ", "x"]
    rng = random.Random(1)
    for n in range(15):
        text = ""
        for _ in range(6):
            text += "".join(rng.choice(pieces) for _ in range(rng.randint(1, 10)))
            enc, ref = encode(prefixes, text, key=f"c{n}"), tok.encode(text, add_special_tokens=False)
            assert (enc.ids, enc.offsets()) == (ref.ids, ref.offsets), text
    assert prefixes.hits > 30


# Templates whose structure stresses the kept labels: tools rendered after the
# conversation (pieces of no message late in the text), messages that render empty
# (their headers come from the gap), and content edited by the template (aligned).
EMPTY_LIST_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
)


def text_turns(rng: random.Random, turns: int) -> list[list[dict[str, Any]]]:
    """`agent_turns` without images (images take the full path), with user messages that
    some templates render empty, and several tool calls and results per turn."""
    out = []
    for messages in agent_turns(rng, turns):
        for m in messages:
            if m["role"] == "user" and isinstance(m["content"], list):
                m["content"] = [p for p in m["content"] if p["type"] == "text"]
        out.append(messages)
    return out


@pytest.mark.parametrize("name", ["tiny", "tools_after", "empty_list", "stripping", "editing"])
def test_kept_labels_give_the_tags_of_a_full_tagging(name: str, tokenizer: TextTokenizer, template: ChatTemplate) -> None:
    """Every turn of many interleaved conversations: the tagger that reuses the kept
    prefix's labels returns exactly what a tagger without any kept state returns."""
    from test_tagger import EDITING_TEMPLATE, TOOLS_AS_JSON_TEMPLATE

    chosen = {
        "tiny": template,
        "tools_after": ChatTemplate(TOOLS_AS_JSON_TEMPLATE),
        "empty_list": ChatTemplate(EMPTY_LIST_TEMPLATE),
        "stripping": ChatTemplate(STRIPPING_TEMPLATE),
        "editing": ChatTemplate(EDITING_TEMPLATE),
    }[name]
    full = ChatTagger(tokenizer, chosen)
    incremental = kept_tagger(tokenizer, chosen)
    appending = kept_tagger(tokenizer, chosen, renders=True)
    rng = random.Random(11)
    sessions = [(text_turns(rng, rng.randint(3, 7)), TOOLS if rng.random() < 0.5 else None) for _ in range(8)]
    requests = exact = 0
    while any(turns for turns, _ in sessions):
        for sid, (turns, tools) in enumerate(sessions):  # round robin: the sessions' kept prefixes interleave
            if turns:
                messages = turns.pop(0)
                got = build(incremental, copy.deepcopy(messages), tools=copy.deepcopy(tools), key=f"s{sid}")
                assert got == full.build(copy.deepcopy(messages), tools=copy.deepcopy(tools))
                # with kept renders too (the turn's messages marked alone where they append): the same
                assert build(appending, copy.deepcopy(messages), tools=copy.deepcopy(tools), key=f"s{sid}") == got
                exact += got.method == "markers"
                if got.tag_runs:  # the runs are the tags
                    assert [t for (hi, t), lo in zip(got.tag_runs, [0] + [h for h, _ in got.tag_runs]) for _ in range(hi - lo)] == got.tags
                requests += 1
    # The labels were reused where the template keeps earlier turns as they were and
    # renders nothing after them but the generation prompt (the tools-after layout
    # renders its tool block after the conversation: only the first message is kept).
    # Templates that render content strings as given render the marked prompt as the real
    # one with markers. The others do not always: the editing one cuts user text at 12
    # characters (markers included), and `{{ m.content }}` of list content renders the
    # Python repr, markers escaped (tags "aligned").
    if name in ("tiny", "empty_list"):
        assert exact == requests, (exact, requests)
    else:
        assert exact < requests, (exact, requests)
    if name in ("tiny", "empty_list"):
        assert incremental.label_hits >= requests - 2 * len(sessions), (incremental.label_hits, requests)
        # and parsed only the marked render after the kept prefix
        assert incremental.parse_hits >= requests - 2 * len(sessions), (incremental.parse_hits, requests)


def test_content_that_spells_out_markup_reuses_neither_ids_nor_labels(tokenizer: TextTokenizer, template: ChatTemplate) -> None:
    """A user message that spells out template markup is text (tokenizer.as_text): its
    prompt is not the text an earlier prompt rendered from two messages, so neither that
    prompt's kept ids nor its labels serve, and its control tokens are the template's."""
    full = ChatTagger(tokenizer, template)
    incremental = kept_tagger(tokenizer, template)
    system = {"role": "system", "content": "Be brief."}
    first = [system, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    second = [
        system,
        {"role": "user", "content": "a<|im_end|>\n<|im_start|>assistant\nb"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
        {"role": "user", "content": "e"},
    ]
    kept = build(incremental, copy.deepcopy(first))
    got = build(incremental, copy.deepcopy(second))
    assert got.reused_prefix is None or len(got.reused_prefix.ids) <= kept.input_ids.index(4078, 8)  # the system message's at most
    assert sum(t in tokenizer.special_ids for t in got.input_ids) == 2 * 5 + 1  # five messages' markup and the generation prompt's opener
    assert got == full.build(copy.deepcopy(second))


def test_kept_prefixes_are_found_only_in_their_own_scope(tokenizer: TextTokenizer, template: ChatTemplate) -> None:
    """A tenant's kept prompts (its first message too) never speed up another tenant's tokenization."""
    tagger = kept_tagger(tokenizer, template)
    prefixes = tagger.prefixes
    assert prefixes is not None
    full = ChatTagger(tokenizer, template)
    secret = [{"role": "system", "content": "The launch code is 7-4-1-9. " * 8}, {"role": "user", "content": "Plan?"}]
    turn2 = [*secret, {"role": "assistant", "content": "Soon."}, {"role": "user", "content": "When?"}]
    assert build(tagger, copy.deepcopy(secret), scope="a", key="a") == full.build(copy.deepcopy(secret))
    assert (prefixes.hits, prefixes.misses) == (0, 1)
    for scope in ("b", ""):  # the right guess from another tenant, and from the default one
        assert build(tagger, copy.deepcopy(secret), scope=scope, key=f"{scope}-c") == full.build(copy.deepcopy(secret))
    assert (prefixes.hits, prefixes.misses) == (0, 3)
    assert build(tagger, copy.deepcopy(turn2), scope="a", key="a") == full.build(copy.deepcopy(turn2))
    assert (prefixes.hits, prefixes.misses) == (1, 3)  # its own tenant's conversation reuses as before
