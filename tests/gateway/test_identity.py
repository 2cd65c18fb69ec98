"""Conversation identity: explicit sources in order, then exact prefix matches
that never merge agents sharing a system prompt or a stripped history."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest

from kvserving.gateway.prompt.chat_template import ChatTemplate
from kvserving.gateway.conversations import SEQUENCES_PER_CONVERSATION, Conversations
from kvserving.gateway.identity import SOURCES, Identities, Identity, explicit_identity, page_chain
from kvserving.gateway.prompt.tagger import ChatTagger, TaggedPrompt
from kvserving.gateway.tenants import DEFAULT_TENANT, Tenant
from kvserving.gateway.prompt.token_prefixes import TokenPrefixes
from kvserving.gateway.prompt.tokenizer import TextTokenizer

from test_chat_template import TOOLS  # noqa: E402  (sibling test module)

SYSTEM = {"role": "system", "content": "You are a coding agent. Use the tools to inspect the repository and answer precisely."}


@pytest.fixture(scope="module")
def tagger(tiny_model_dir: Path) -> ChatTagger:
    return ChatTagger(TextTokenizer.from_dir(tiny_model_dir), ChatTemplate.from_dir(tiny_model_dir))


def fresh_index(store: Conversations | None = None, **kwargs: Any) -> Identities:
    counter = itertools.count(1)
    return Identities(store if store is not None else Conversations(), new_suffix=lambda: str(next(counter)), **kwargs)


class Agent:
    """A client that resends its whole history each turn, like an OpenAI client."""

    def __init__(
        self, tagger: ChatTagger, index: Identities, first: str, *, strip_reasoning: bool = False, headers: dict[str, str] | None = None
    ) -> None:
        self.tagger, self.index = tagger, index
        self.messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": first}]
        self.strip_reasoning = strip_reasoning
        self.headers = headers or {}

    def send(self) -> tuple[Identity, TaggedPrompt]:
        """One request: identify, remember the prompt (what the gateway does at request time)."""
        prompt = self.tagger.build(self.messages, tools=TOOLS)
        ident = self.index.identify(tenant=DEFAULT_TENANT, headers=self.headers, body={"model": "tiny"}, prompt=prompt)
        self.index.remember(ident.key, prompt.input_ids, tenant=DEFAULT_TENANT)
        return ident, prompt

    def answer(
        self, ident: Identity, prompt: TaggedPrompt, reasoning: str, text: str, *, tool_call: str | None = None, with_eos: bool = True
    ) -> None:
        """The model's output: remembered as prompt + output ids; the client appends the message."""
        tok = self.tagger.tokenizer
        generated = f"<think>\n{reasoning}\n</think>\n\n{text}"
        if tool_call is not None:
            generated += f'\n<tool_call>\n{{"name": "{tool_call}", "arguments": {{}}}}\n</tool_call>'
        eos = tok.eos_token_id
        assert eos is not None
        self.index.remember(ident.key, prompt.input_ids + tok.encode_ids(generated) + ([eos] if with_eos else []), tenant=DEFAULT_TENANT)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text if self.strip_reasoning else f"<think>\n{reasoning}\n</think>\n\n{text}",
        }
        if tool_call is not None:
            message["tool_calls"] = [{"id": "c", "type": "function", "function": {"name": tool_call, "arguments": "{}"}}]
        self.messages.append(message)

    def tool_result(self, content: str) -> None:
        self.messages.append({"role": "tool", "tool_call_id": "c", "content": content})

    def user(self, content: str) -> None:
        self.messages.append({"role": "user", "content": content})


# -- sources 1-3 ----------------------------------------------------------------


def test_header_order_and_case() -> None:
    headers = {"X-Claude-Code-Session-Id": "claude", "x-correlation-id": "corr", "X-SESSION-AFFINITY": "aff"}
    assert explicit_identity(headers, {}) == Identity("session:aff", "x-session-affinity")
    assert explicit_identity({**headers, "x-session-id": "sid"}, {"user": "u"}) == Identity("session:sid", "x-session-id")
    assert explicit_identity({"X-Dynamo-Session-ID": "d", "x-claude-code-session-id": "c"}, {}) == Identity(
        "session:d", "x-dynamo-session-id"
    )
    assert explicit_identity({"x-claude-code-session-id": "c"}, {}) == Identity("session:c", "x-claude-code-session-id")


def test_body_fields_after_headers() -> None:
    assert explicit_identity({}, {"prompt_cache_key": "pk", "user": "u"}) == Identity("cache:pk", "prompt_cache_key")
    assert explicit_identity({}, {"user": "u"}) == Identity("user:u", "user")
    assert explicit_identity({"x-session-id": "s"}, {"prompt_cache_key": "pk"}) == Identity("session:s", "x-session-id")


def test_blank_or_odd_values_are_skipped_and_long_ones_hashed() -> None:
    assert explicit_identity({"x-session-id": "  "}, {"prompt_cache_key": "", "user": 5}) is None
    assert explicit_identity({"x-session-id": " a "}, {}) == Identity("session:a", "x-session-id")
    long = explicit_identity({"x-session-id": "x" * 1000}, {})
    assert long is not None and long.key.startswith("session:sha256-") and len(long.key) < 100
    assert {"prefix", "new", "user", "prompt_cache_key", "x-session-id"} <= set(SOURCES)


# -- source 4: prefix -------------------------------------------------------------


def test_multi_turn_agent_keeps_one_key(tagger: ChatTagger) -> None:
    index = fresh_index()
    agent = Agent(tagger, index, "Where is the config parsed?")
    first, prompt = agent.send()
    assert first.source == "new" and first.key.startswith("conv-")
    agent.answer(first, prompt, "I should list files.", "Let me look.", tool_call="list_files")
    agent.tool_result("config.py main.py")
    second, prompt2 = agent.send()  # tool loop: same user turn
    assert (second.key, second.source) == (first.key, "prefix")
    # It continued prompt + output, not only the earlier prompt.
    assert second.matched_tokens > len(prompt.input_ids)
    agent.answer(second, prompt2, "It is config.py.", "In config.py.")
    agent.user("And where is it validated?")
    third, _ = agent.send()  # a new user turn
    assert (third.key, third.source) == (first.key, "prefix")


def test_output_remembered_without_its_stop_token_still_matches(tagger: ChatTagger) -> None:
    index = fresh_index()
    agent = Agent(tagger, index, "Where is the config parsed?")
    first, prompt = agent.send()
    agent.answer(first, prompt, "look", "In config.py.", with_eos=False)
    agent.user("And validated?")
    second, _ = agent.send()
    assert (second.key, second.source) == (first.key, "prefix")
    assert second.matched_tokens > len(prompt.input_ids)


def test_two_agents_with_the_same_system_prompt_stay_apart(tagger: ChatTagger) -> None:
    index = fresh_index()
    a = Agent(tagger, index, "Where is the config parsed?")
    b = Agent(tagger, index, "Why does the test fail?")
    ia, pa = a.send()
    ib, pb = b.send()
    assert ia.source == ib.source == "new" and ia.key != ib.key
    a.answer(ia, pa, "look", "config.py")
    b.answer(ib, pb, "think", "A race.")
    a.user("more?")
    b.user("fix it")
    assert [(i.key, i.source) for i in (a.send()[0], b.send()[0])] == [(ia.key, "prefix"), (ib.key, "prefix")]


def test_identical_first_prompts_are_two_conversations(tagger: ChatTagger) -> None:
    """A benchmark harness sending one task to many sessions: same first prompt,
    different answers; each continuation goes to its own conversation."""
    index = fresh_index()
    a = Agent(tagger, index, "Solve task 7.")
    b = Agent(tagger, index, "Solve task 7.")
    ia, pa = a.send()
    ib, pb = b.send()
    # An identical prompt is not a continuation: the second session gets the
    # first-turn key with a suffix.
    assert (ib.source, ib.key) == ("new", f"{ia.key}-1")
    a.answer(ia, pa, "plan A", "Answer A.")
    b.answer(ib, pb, "plan B", "Answer B.")
    a.user("next")
    b.user("next")
    assert a.send()[0].key == ia.key
    assert b.send()[0].key == ib.key


def test_client_that_strips_reasoning(tagger: ChatTagger) -> None:
    index = fresh_index()
    # Without a header: the earlier prompt still prefixes the new one, but only
    # up to the stripped message, so it is not taken as the same conversation.
    plain = Agent(tagger, index, "Where is the config parsed?", strip_reasoning=True)
    i1, p1 = plain.send()
    plain.answer(i1, p1, "I should think hard.", "In config.py.")
    plain.user("Thanks. Where is it validated?")
    i2, _ = plain.send()
    assert i2.source == "new" and i2.key != i1.key
    # With a header the same client is recognised every turn.
    index2 = fresh_index()
    named = Agent(tagger, index2, "Where is the config parsed?", strip_reasoning=True, headers={"X-Session-ID": "s-42"})
    j1, q1 = named.send()
    named.answer(j1, q1, "I should think hard.", "In config.py.")
    named.user("Thanks. Where is it validated?")
    assert named.send()[0] == j1 == Identity(DEFAULT_TENANT.scope("session:s-42"), "x-session-id")


def test_stripped_client_is_not_merged_into_another_session_with_the_same_first_turn(tagger: ChatTagger) -> None:
    index = fresh_index()
    other = Agent(tagger, index, "Where is the config parsed?")
    io, po = other.send()
    other.answer(io, po, "hmm", "In config.py.")
    stripped = Agent(tagger, index, "Where is the config parsed?", strip_reasoning=True)
    i1, p1 = stripped.send()
    stripped.answer(i1, p1, "I should think hard.", "In config.py.")
    stripped.user("Thanks. Where is it validated?")
    i2, _ = stripped.send()
    assert i2.key not in (io.key, i1.key) and i2.source == "new"


def test_another_replica_mints_the_same_key_for_a_later_turn(tagger: ChatTagger) -> None:
    """Header-less conversations keep one key across gateway replicas: the key
    of a new conversation comes from its first user turn."""
    replica1, replica2 = fresh_index(), fresh_index()
    agent = Agent(tagger, replica1, "Where is the config parsed?")
    i1, p1 = agent.send()
    agent.answer(i1, p1, "look", "In config.py.")
    agent.user("And validated?")
    i2, p2 = agent.send()
    assert i2.key == i1.key and i2.source == "prefix"
    # The same turn lands on a replica that never saw the conversation.
    seen_by_2 = replica2.identify(tenant=DEFAULT_TENANT, headers={}, body={}, prompt=p2)
    assert seen_by_2 == Identity(i1.key, "new")
    # Different first messages mint different keys; completions (no turns) a random one.
    other = Agent(tagger, replica2, "Why does the test fail?")
    assert other.send()[0].key != i1.key
    raw = replica2.identify(tenant=DEFAULT_TENANT, headers={}, body={}, prompt=tagger.tag_text("raw text"))
    assert raw == Identity(DEFAULT_TENANT.scope("conv:1"), "new")


def test_retry_of_the_same_prompt_is_not_a_continuation(tagger: ChatTagger) -> None:
    index = fresh_index()
    agent = Agent(tagger, index, "hello")
    first, _ = agent.send()
    again, _ = agent.send()
    assert again.source == "new" and again.key != first.key


def test_completion_prompts_match_by_extension(tagger: ChatTagger) -> None:
    index = fresh_index()
    p1 = tagger.tag_text("def parse(path):\n    with open(path) as f:\n")
    i1 = index.identify(tenant=DEFAULT_TENANT, headers={}, body={}, prompt=p1)
    index.remember(i1.key, p1.input_ids, tenant=DEFAULT_TENANT)
    p2 = tagger.tag_text("def parse(path):\n    with open(path) as f:\n        return f.read()\n")
    assert p2.input_ids[: len(p1.input_ids)] == p1.input_ids
    assert index.identify(tenant=DEFAULT_TENANT, headers={}, body={}, prompt=p2) == Identity(i1.key, "prefix", len(p1.input_ids))


# -- bounds -----------------------------------------------------------------------------


class Plain:
    """A prompt with no structure: every token current user text."""

    def __init__(self, ids: list[int]) -> None:
        self.input_ids = ids
        self.tags = [7 * 0 + 1] * len(ids)  # current/text/user
        self.turn_starts: tuple[int, ...] = ()
        self.current_turn_start = 0


def test_sequences_are_bounded_per_conversation_and_go_with_their_record() -> None:
    store = Conversations(max_conversations=3)
    index = fresh_index(store, page_size=4)
    for n in range(1, 6):
        index.remember("a", list(range(n * 5)), tenant=DEFAULT_TENANT)
    a = store.get("a")
    assert a is not None and len(a.sequences) == SEQUENCES_PER_CONVERSATION == 4  # only the 4 latest of "a"
    assert index.match(Plain(list(range(11))), tenant=DEFAULT_TENANT) == Identity("a", "prefix", 10)
    assert index.match(Plain(list(range(6))), tenant=DEFAULT_TENANT) is None  # its first sequence was dropped
    for key in "bcd":
        index.remember(key, [ord(key)] * 9, tenant=DEFAULT_TENANT)
    # the store keeps 3 records: "a", the least recently used, left with its sequences
    assert [c.key for c in store] == ["b", "c", "d"]
    assert index.match(Plain(list(range(11))), tenant=DEFAULT_TENANT) is None
    assert index.match(Plain([ord("d")] * 12), tenant=DEFAULT_TENANT) == Identity("d", "prefix", 9)
    store.forget("d")
    assert index.match(Plain([ord("d")] * 12), tenant=DEFAULT_TENANT) is None
    # a match makes its record the most recently used
    assert index.match(Plain([ord("b")] * 12), tenant=DEFAULT_TENANT) == Identity("b", "prefix", 9)
    assert [c.key for c in store] == ["c", "b"]


def test_latest_registrant_of_an_identical_sequence_owns_it() -> None:
    index = fresh_index(page_size=4)
    index.remember("a", [1, 2, 3, 4, 5], tenant=DEFAULT_TENANT)
    index.remember("b", [1, 2, 3, 4, 5], tenant=DEFAULT_TENANT)
    assert index.match(Plain([1, 2, 3, 4, 5, 6]), tenant=DEFAULT_TENANT) == Identity("b", "prefix", 5)
    a = index.store.get("a")
    assert a is not None and a.sequences == []


def test_tail_tokens_must_match_exactly() -> None:
    index = fresh_index(page_size=4)
    index.remember("a", [1, 2, 3, 4, 5, 6], tenant=DEFAULT_TENANT)
    assert index.match(Plain([1, 2, 3, 4, 5, 7, 8]), tenant=DEFAULT_TENANT) is None
    assert index.match(Plain([1, 2, 3, 4, 5, 6, 8]), tenant=DEFAULT_TENANT) == Identity("a", "prefix", 6)


def test_page_chain_is_prefix_stable() -> None:
    a = page_chain(list(range(40)), 16)
    b = page_chain(list(range(35)) + [0] * 10, 16)
    assert len(a) == 3 and a[:3] == b[:3]
    assert page_chain(list(range(33)), 16)[2] != page_chain([9] + list(range(1, 33)), 16)[2]


def test_invalid_bounds_name_the_field() -> None:
    with pytest.raises(ValueError, match="page_size"):
        Identities(Conversations(), page_size=0)


def test_page_chain_from_a_known_prefix_equals_the_whole_chain() -> None:
    rng = random.Random(4)
    for _ in range(200):
        size = rng.choice([1, 4, 16])
        ids = [rng.randrange(1000) for _ in range(rng.randrange(0, 120))]
        m = rng.randrange(0, len(ids) + 1)
        assert page_chain(ids, size, known=page_chain(ids[:m], size)) == page_chain(ids, size)


def test_remembering_with_the_prompts_chain_files_the_same_records(tagger: ChatTagger) -> None:
    """`identify` hands back the prompt's page chain (prefix match computed it); `remember` at the
    turn's end reuses it for the prompt's pages: the index ends in the same state, and a chain
    of the wrong length is ignored."""
    plain, reused = fresh_index(), fresh_index()
    agents = [Agent(tagger, index, "Fix the failing test.") for index in (plain, reused)]
    for turn in range(4):
        for agent, index in zip(agents, (plain, reused), strict=True):
            prompt = agent.tagger.build(agent.messages, tools=TOOLS)
            ident = index.identify(tenant=DEFAULT_TENANT, headers={}, body={"model": "tiny"}, prompt=prompt)
            output = agent.tagger.tokenizer.encode_ids(f"Step {turn} done.")
            if index is reused:
                assert ident.chain is None or list(ident.chain) == page_chain(prompt.input_ids, index.page_size)
                index.remember(
                    ident.key, prompt.input_ids + output, prefix=len(prompt.input_ids), prefix_chain=ident.chain, tenant=DEFAULT_TENANT
                )
                index.remember(
                    ident.key, prompt.input_ids + output, prefix=len(prompt.input_ids), prefix_chain=[0, 1], tenant=DEFAULT_TENANT
                )
            else:
                index.remember(ident.key, prompt.input_ids + output, prefix=len(prompt.input_ids), tenant=DEFAULT_TENANT)
                index.remember(ident.key, prompt.input_ids + output, prefix=len(prompt.input_ids), tenant=DEFAULT_TENANT)
            agent.messages.append({"role": "assistant", "content": f"Step {turn} done."})
            agent.user(f"Now step {turn + 1}.")
        assert list(plain.store._sequence_owner.items()) == list(reused.store._sequence_owner.items())
    assert (
        reused.identify(tenant=DEFAULT_TENANT, headers={}, body={}, prompt=tagger.build(agents[1].messages, tools=TOOLS)).chain is not None
    )


def test_the_chain_continues_from_the_kept_prefix_and_equals_the_whole_chain(tagger: ChatTagger) -> None:
    """With tokenized prefixes, identity keeps its page chain on each prefix a prompt filed and the
    next turn continues it: every chain equals the whole prompt's, and from the third turn on the
    prompt's prefix carried one (in this index's page size only)."""
    store = Conversations()
    prefixed = ChatTagger(tagger.tokenizer, tagger.template, prefixes=TokenPrefixes(tagger.tokenizer, store))
    index, other = fresh_index(store), fresh_index(page_size=4)
    agent = Agent(prefixed, index, "Fix the failing test.")
    for turn in range(5):
        prompt = prefixed.build(agent.messages, tools=TOOLS)
        ident = index.identify(tenant=DEFAULT_TENANT, headers={}, body={"model": "tiny"}, prompt=prompt)
        if turn:
            assert ident.chain is not None and list(ident.chain) == page_chain(prompt.input_ids, 16)
            carried = getattr(prompt.reused_prefix, "page_chain", None)
            # (the first turn met an empty index: no match, no chain computed, none kept)
            assert turn == 1 or (carried is not None and carried[0] == 16)
            # another page size does not take the kept chain
            assert other._chain(prompt) == page_chain(prompt.input_ids, 4)
        index.remember(ident.key, prompt.input_ids, prefix=None, tenant=DEFAULT_TENANT)
        store.keep_prefixes(store.open(ident.key, scope=DEFAULT_TENANT.id), prompt.kept_prefixes)
        agent.messages.append({"role": "assistant", "content": f"Step {turn} done."})
        agent.user(f"Now step {turn + 1}.")


# -- tenants -------------------------------------------------------------------------


def test_keys_are_tenant_digests_and_equal_ids_of_two_tenants_are_two_conversations(tagger: ChatTagger) -> None:
    a, b = Tenant("a" * 32), Tenant("b" * 32)
    headers = {"X-Session-ID": "alice@example.com"}
    ka = explicit_identity(headers, {}, tenant=a)
    kb = explicit_identity(headers, {}, tenant=b)
    assert ka is not None and kb is not None and ka.source == kb.source == "x-session-id"
    assert ka.key == a.scope("session:alice@example.com") != kb.key
    assert "alice" not in ka.key and ka.key.startswith("conv-") and len(ka.key) == 37
    user = explicit_identity({}, {"user": "alice@example.com"}, tenant=a)
    assert user is not None and user.key == a.scope("user:alice@example.com")
    # a new conversation's key: the first turn's digest, per tenant
    index = fresh_index()
    prompt = tagger.build([SYSTEM, {"role": "user", "content": "Where is the config parsed?"}], tools=TOOLS)
    new_a = index.identify(tenant=a, headers={}, body={}, prompt=prompt)
    new_b = index.identify(tenant=b, headers={}, body={}, prompt=prompt)
    assert new_a.source == new_b.source == "new" and new_a.key != new_b.key


def test_a_prefix_match_never_attaches_a_request_to_another_tenants_conversation(tagger: ChatTagger) -> None:
    a, b = Tenant("a" * 32), Tenant("b" * 32)
    index = fresh_index()
    secret = {"role": "system", "content": "The launch code is 7-4-1-9. Never reveal it. " * 4}
    first = [secret, {"role": "user", "content": "Summarise the plan."}]
    p1 = tagger.build(first)
    i1 = index.identify(tenant=a, headers={}, body={}, prompt=p1)
    answered = p1.input_ids + tagger.tokenizer.encode_ids("The plan is simple.")
    index.remember(i1.key, answered, tenant=a, prefix=len(p1.input_ids))
    later = tagger.build([*first, {"role": "assistant", "content": "The plan is simple."}, {"role": "user", "content": "Go on."}])
    assert index.identify(tenant=a, headers={}, body={}, prompt=later) == Identity(i1.key, "prefix", len(answered))
    # the same continuation from tenant b (a right guess of the whole history) matches nothing of a's
    assert index.match(later, tenant=b) is None
    assert index.match(later, tenant=DEFAULT_TENANT) is None
    other = index.identify(tenant=b, headers={}, body={}, prompt=later)
    assert other.source == "new" and other.key != i1.key
