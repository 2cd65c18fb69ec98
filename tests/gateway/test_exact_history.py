"""Exact history: the next turn starts with the ids the workers hold (prompt +
sampled reply), even when the reply is not the canonical tokenization of its
text or holds special tokens the client never saw; tags and turn starts follow
the text; anything that does not extend the held text is left alone."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvserving.gateway.prompt.chat_template import ChatTemplate
from kvserving.gateway.conversations import Conversations
from kvserving.gateway.exact_history import ExactHistory, Sent
from kvserving.gateway.prompt.tagger import ChatTagger, TaggedPrompt
from kvserving.gateway.prompt.token_prefixes import TokenPrefixes
from kvserving.gateway.prompt.tokenizer import Encoded, TextTokenizer
from kvserving.tags import decode_tag

FIRST = [{"role": "system", "content": "You are a careful agent."}, {"role": "user", "content": "List the files, then read setup.py."}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def tagger(tiny_model_dir: Path, tok: TextTokenizer) -> ChatTagger:
    return ChatTagger(tok, ChatTemplate.from_dir(tiny_model_dir))


class History:
    """Exact history on conversation records, as the gateway runs it: a request opens its
    record and files its kept prefixes, splices onto what the record holds; the turn's end
    holds the prompt as sent plus the sampled ids."""

    def __init__(self, tok: TextTokenizer, store: Conversations | None = None) -> None:
        self.exact = ExactHistory(tok)
        self.store = store if store is not None else Conversations()

    def splice(self, key: str, prompt: TaggedPrompt) -> Sent:
        conv = self.store.open(key, scope="")
        self.store.keep_prefixes(conv, prompt.kept_prefixes)
        return self.exact.splice(conv.held, prompt)

    def record(self, key: str, sent: Sent, output_ids: list[int], output_text: str) -> None:
        self.store.hold(self.store.open(key, scope=""), self.exact.held_after(sent, output_ids, output_text))


def _one_token_per_char(tok: TextTokenizer, text: str) -> list[int]:
    """Ids that decode to ``text`` but are not its canonical tokenization."""
    ids = [i for ch in text for i in tok.encode(ch).ids]
    assert tok.decode(ids) == text and ids != tok.encode(text).ids
    return ids


def _second_turn(reply_text: str) -> list[dict]:
    return FIRST + [{"role": "assistant", "content": reply_text}, {"role": "user", "content": "Now run the tests."}]


def _play(tagger: ChatTagger, tok: TextTokenizer, reply_ids: list[int]) -> tuple[History, list[int], TaggedPrompt]:
    """Turn 1 through the history, the reply recorded; returns what the workers hold and turn 2 as rendered."""
    history = History(tok)
    sent = history.splice("conv", tagger.build(FIRST))
    assert not sent.spliced
    reply_text = tok.decode(reply_ids)  # what the gateway streamed (special tokens hidden)
    history.record("conv", sent, reply_ids, reply_text)
    return history, sent.prompt.input_ids + reply_ids, tagger.build(_second_turn(reply_text))


def test_splice_keeps_the_sampled_ids_and_reads_the_same_text(tagger: ChatTagger, tok: TextTokenizer) -> None:
    im_end = tok.encode("<|im_end|>").ids
    reply = _one_token_per_char(tok, "Reading setup.py now.")
    history, held, canonical = _play(tagger, tok, reply + im_end)
    held = held[: -len(im_end)]  # the stop token is not kept: the template renders its own
    assert canonical.input_ids[: len(held)] != held  # re-tokenizing loses the held ids
    assert list(canonical.char_starts) == [a for a, _ in tok.encode(canonical.text).offsets]  # from the tagger
    sent = history.splice("conv", canonical)
    assert sent.spliced
    spliced = sent.prompt
    assert spliced.input_ids[: len(held)] == held
    assert tok.decode(spliced.input_ids, skip_special_tokens=False) == canonical.text
    assert len(spliced.tags) == len(spliced.input_ids) == len(spliced.char_starts)
    assert {decode_tag(t) for t in spliced.tags[len(held) - len(reply) : len(held)]} == {("turn_m1", "text", "assistant")}
    # user turns start at the same characters as in the canonical prompt, and tags after the reply agree
    assert len(spliced.turn_starts) == len(canonical.turn_starts) == 2
    assert spliced.turn_starts[0] == canonical.turn_starts[0]
    tail = len(canonical.input_ids) - canonical.turn_starts[1]
    assert spliced.input_ids[-tail:] == canonical.input_ids[-tail:]
    assert spliced.tags[-tail:] == canonical.tags[-tail:]
    assert spliced.turn_starts[1] == len(spliced.input_ids) - tail


def test_hidden_special_tokens_and_broken_utf8_stay_in_the_held_ids(tagger: ChatTagger, tok: TextTokenizer) -> None:
    hidden = tok.encode("<|box_start|>").ids
    assert tok.decode(hidden) == ""  # the client never sees it
    lone = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"][:1]
    reply = tok.encode("Reading").ids + hidden + lone + tok.encode(" setup.py").ids
    history, held, canonical = _play(tagger, tok, reply)
    sent = history.splice("conv", canonical)
    assert sent.spliced and sent.prompt.input_ids[: len(held)] == held
    # the text the model reads differs from the rendered one only by the hidden token
    assert tok.decode(sent.prompt.input_ids) == tok.decode(canonical.input_ids)
    # and a third turn extends the second one's ids in turn
    history.record("conv", sent, tok.encode("Done.").ids, "Done.")
    third = tagger.build(
        _second_turn(tok.decode(reply)) + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks."}]
    )
    again = history.splice("conv", third)
    assert again.prompt.input_ids[: len(sent.prompt.input_ids)] == sent.prompt.input_ids


def test_no_splice_when_history_was_edited_or_unknown(tagger: ChatTagger, tok: TextTokenizer) -> None:
    history, _, canonical = _play(tagger, tok, _one_token_per_char(tok, "Reading setup.py now."))
    edited = _second_turn("Reading pyproject.toml now.")
    assert not history.splice("conv", tagger.build(edited)).spliced
    other = history.splice("other", canonical)
    assert not other.spliced and other.prompt is canonical


def test_canonical_history_is_sent_as_rendered(tagger: ChatTagger, tok: TextTokenizer) -> None:
    history, _, canonical = _play(tagger, tok, tok.encode("Reading setup.py now.").ids)
    sent = history.splice("conv", canonical)
    assert not sent.spliced and sent.prompt is canonical


def test_held_history_is_bounded_by_the_store_lru(tagger: ChatTagger, tok: TextTokenizer) -> None:
    history = History(tok, Conversations(max_conversations=2))
    sent = history.splice("x", tagger.build(FIRST))
    for key in ("a", "b", "c"):
        history.record(key, sent, [], "")
    assert [c.key for c in history.store] == ["b", "c"]
    with pytest.raises(ValueError, match="max_conversations"):
        Conversations(max_conversations=0)


def test_held_history_is_bounded_in_tokens_least_recent_first(tagger: ChatTagger, tok: TextTokenizer) -> None:
    sent = History(tok).splice("x", tagger.build(FIRST))
    n = len(sent.prompt.input_ids)
    history = History(tok, Conversations(max_tokens=3 * (n + 2)))
    for key in ("a", "b", "c"):
        history.record(key, sent, [11, 12], "")
    assert len(history.store) == 3 and history.store.tokens == 3 * (n + 2)
    history.splice("a", tagger.build(_second_turn("")))  # a request of "a": "b" is now the least recent
    history.record("d", sent, [11, 12], "")
    assert history.store.tokens == 3 * (n + 2) and history.store.get("b") is None
    assert history.splice("b", tagger.build(_second_turn(""))).spliced is False
    assert history.splice("a", tagger.build(_second_turn(""))).spliced
    history.store.forget("a")
    assert history.store.tokens == 2 * (n + 2)
    alone = History(tok, Conversations(max_tokens=1))  # the conversation just recorded stays, alone
    alone.record("a", sent, [], "")
    alone.record("b", sent, [], "")
    assert [c.key for c in alone.store] == ["b"] and alone.store.tokens == n
    with pytest.raises(ValueError, match="max_tokens"):
        Conversations(max_tokens=0)


def test_retag_by_runs_equals_the_tag_of_the_covering_canonical_token() -> None:
    """Mapping by runs (one bisection per run of equal tags) gives every token the tag
    of the last canonical token starting at or before its first character, as a step
    per token would; repeated starts (a character split over two byte tokens), held
    tokens before the first and after the last canonical start included."""
    import bisect
    import itertools
    import random

    from kvserving.gateway.exact_history import _retag
    from kvserving.gateway.prompt.tagger import TaggedPrompt

    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(1, 40)
        canon = sorted(rng.randint(0, 60) for _ in range(n))
        tags = [rng.choice([3, 3, 3, 17, 20]) for _ in range(n)]
        held = tuple(sorted(rng.randint(-2, 70) for _ in range(rng.randint(1, 50))))
        runs, end = [], 0
        for tag, group in itertools.groupby(tags):
            end += len(list(group))
            runs.append((end, tag))
        want = [tags[max(0, min(n - 1, bisect.bisect_right(canon, c) - 1))] for c in held]
        for tag_runs in ((), tuple(runs)):  # the tagger's runs, or none (one step per token)
            prompt = TaggedPrompt(text="x" * 70, input_ids=list(range(n)), tags=tags, char_starts=tuple(canon), tag_runs=tag_runs)
            got = _retag(prompt, list(range(len(held))), held, tuple(canon))
            assert got.tags == want
            expanded, lo = [], 0
            for hi, tag in got.tag_runs:
                assert hi > lo
                expanded += [tag] * (hi - lo)
                lo = hi
            assert expanded == want


@pytest.mark.parametrize("prefixed", [False, True])
def test_ids_json_is_the_json_of_the_ids_sent_in_every_case(tagger: ChatTagger, tok: TextTokenizer, prefixed: bool) -> None:
    """The worker body's ids come from ``Sent.ids_json`` (built from the held ids' text, or
    from the tagger's kept prefix: ``TaggedPrompt.ids_json``): it must equal the ids,
    whether the prompt is new, extends the held ids as rendered, is spliced onto them, or
    was edited; after records with hidden, broken and no output."""
    history = History(tok)
    seen: list[str] = []
    from_prefix = 0
    if prefixed:  # prompts that extend a kept prefix carry their ids' JSON
        tagger = ChatTagger(tok, tagger.template, prefixes=TokenPrefixes(tok, history.store))

    def splice(key: str, prompt: TaggedPrompt) -> object:
        nonlocal from_prefix
        sent = history.splice(key, prompt)
        assert json.loads(sent.ids_json) == sent.prompt.input_ids
        seen.append("spliced" if sent.spliced else "as_rendered")
        from_prefix += bool(prompt.ids_json) and not sent.spliced
        return sent

    first = splice("conv", tagger.build(FIRST))
    hidden = tok.encode("<|box_start|>").ids
    lone = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"][:1]
    reply = _one_token_per_char(tok, "Reading") + hidden + lone + tok.encode(" setup.py").ids
    history.record("conv", first, reply + tok.encode("<|im_end|>").ids, tok.decode(reply))
    second = splice("conv", tagger.build(_second_turn(tok.decode(reply))))
    history.record("conv", second, tok.encode("Done.").ids, "Done.")  # canonical: the next turn extends as rendered
    third_messages = _second_turn(tok.decode(reply)) + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks."}]
    third = splice("conv", tagger.build(third_messages))
    history.record("conv", third, [], "")  # nothing came back
    splice("conv", tagger.build(third_messages + [{"role": "user", "content": "And?"}]))  # no generation prompt held: no extension
    splice("conv", tagger.build(_second_turn("Edited.")))  # does not extend the held text
    canon = splice("canon", tagger.build(FIRST))  # a new conversation
    history.record("canon", canon, tok.encode("Reading setup.py now.").ids, "Reading setup.py now.")
    extended = tagger.build(_second_turn("Reading setup.py now."))
    assert extended.input_ids[: len(canon.prompt.input_ids)] == canon.prompt.input_ids
    splice("canon", extended)  # the rendered ids extend the held ones: sent as rendered, ids from the held text
    assert seen == ["as_rendered", "spliced", "spliced", "as_rendered", "as_rendered", "as_rendered", "as_rendered"]
    assert from_prefix == (5 if prefixed else 0)


class _NoPieces:
    """The tokenizer without ``piece_texts``: starts from windowed decodes."""

    def __init__(self, tok: TextTokenizer) -> None:
        self.tok = tok

    def encode(self, text: str) -> Encoded:
        return self.tok.encode(text)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def piece_texts(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> list[str] | None:
        return None


@pytest.mark.parametrize("seed", range(4))
def test_visible_starts_from_piece_texts_equal_the_windowed_decodes(tok: TextTokenizer, seed: int) -> None:
    rng = random.Random(seed)
    text = "Reading setup.py now; then tests. " * 3 + "naïve café ✓ 日本語"
    ids = tok.encode_ids(text)
    if seed % 2:
        ids = ids[: len(ids) // 2]  # plain text only: the fast path
    ids = ids + [rng.choice(sorted(tok.special_ids))] * (seed % 3)
    shown = tok.decode(ids)
    fast, slow = ExactHistory(tok), ExactHistory(_NoPieces(tok))
    assert fast._visible_starts(ids, shown) == slow._visible_starts(ids, shown)
    assert (tok.piece_texts(ids) is not None) == bool(seed % 2)
