"""Exact history: the next turn starts with the ids the workers hold (prompt +
sampled reply), even when the reply is not the canonical tokenization of its
text; tags and turn starts follow the text; anything else is left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserving.gateway.chat_template import ChatTemplate
from kvserving.gateway.exact_history import ExactHistory
from kvserving.gateway.tagger import ChatTagger
from kvserving.gateway.tokenizer import TextTokenizer
from kvserving.tags import decode_tag

SYSTEM = {"role": "system", "content": "You are a careful agent."}


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def tagger(tiny_model_dir: Path, tok: TextTokenizer) -> ChatTagger:
    return ChatTagger(tok, ChatTemplate.from_dir(tiny_model_dir))


def _non_canonical_reply(tok: TextTokenizer, text: str) -> list[int]:
    """Ids that decode to ``text`` but are not its canonical tokenization (one token per character)."""
    ids: list[int] = []
    for ch in text:
        ids += tok.encode(ch).ids
    assert tok.decode(ids, skip_special_tokens=False) == text and ids != tok.encode(text).ids
    return ids


def _turn(tagger: ChatTagger, tok: TextTokenizer, reply_ids: list[int]) -> tuple[list[int], list[dict]]:
    first = [SYSTEM, {"role": "user", "content": "List the files, then read setup.py."}]
    prompt = tagger.build(first)
    reply_text = tok.decode(reply_ids, skip_special_tokens=False)
    second = first + [{"role": "assistant", "content": reply_text.removesuffix("<|im_end|>")},
                      {"role": "user", "content": "Now run the tests."}]
    return prompt.input_ids + reply_ids, second


def test_splice_keeps_the_sampled_ids_and_reads_the_same_text(tagger: ChatTagger, tok: TextTokenizer) -> None:
    reply = _non_canonical_reply(tok, "Reading setup.py now.") + tok.encode("<|im_end|>").ids
    held, second = _turn(tagger, tok, reply)
    history = ExactHistory(tok)
    history.record("conv", held)
    canonical = tagger.build(second)
    assert canonical.input_ids[: len(held)] != held  # re-tokenizing loses the held ids
    spliced = history.splice("conv", canonical)
    assert spliced.input_ids[: len(held)] == held
    assert tok.decode(spliced.input_ids, skip_special_tokens=False) == canonical.text
    assert len(spliced.tags) == len(spliced.input_ids)
    # the same text carries the same tags: the reply is (turn_m1) assistant text, the new user text current user
    reply_tags = {decode_tag(t) for t in spliced.tags[len(held) - len(reply) : len(held) - 1]}
    assert reply_tags == {("turn_m1", "text", "assistant")}
    assert decode_tag(spliced.tags[-4])[::2] == ("current", "delim") or decode_tag(spliced.tags[-4])[0] == "current"
    user_now = [decode_tag(t) for t in spliced.tags[spliced.turn_starts[-1]:]]
    assert ("current", "text", "user") in user_now
    # user turns start at the same characters as in the canonical prompt
    assert len(spliced.turn_starts) == len(canonical.turn_starts) == 2
    assert spliced.turn_starts[0] == canonical.turn_starts[0]  # before the reply: same tokens
    assert tok.decode(spliced.input_ids[spliced.turn_starts[1]:], skip_special_tokens=False) == \
        tok.decode(canonical.input_ids[canonical.turn_starts[1]:], skip_special_tokens=False)


def test_a_broken_utf8_reply_still_splices(tagger: ChatTagger, tok: TextTokenizer) -> None:
    euro = tok.encode("€").ids  # three bytes; its first byte alone decodes to U+FFFD
    byte_ids = [i for i in range(tok.vocab_size) if tok.decode([i], skip_special_tokens=False) == "\ufffd"]
    assert byte_ids
    reply = byte_ids[:1] + tok.encode(" ok").ids + euro
    held, second = _turn(tagger, tok, reply)
    history = ExactHistory(tok)
    history.record("conv", held)
    spliced = history.splice("conv", tagger.build(second))
    assert spliced.input_ids[: len(held)] == held
    assert tok.decode(spliced.input_ids, skip_special_tokens=False) == tagger.build(second).text


def test_no_splice_when_history_was_edited_or_unknown(tagger: ChatTagger, tok: TextTokenizer) -> None:
    reply = _non_canonical_reply(tok, "Reading setup.py now.")
    held, second = _turn(tagger, tok, reply)
    history = ExactHistory(tok)
    history.record("conv", held)
    edited = [dict(m) for m in second]
    edited[2]["content"] = "Reading pyproject.toml now."
    prompt = tagger.build(edited)
    assert history.splice("conv", prompt) is prompt
    assert history.splice("other", tagger.build(second)).input_ids == tagger.build(second).input_ids


def test_canonical_history_is_returned_unchanged(tagger: ChatTagger, tok: TextTokenizer) -> None:
    reply = tok.encode("Reading setup.py now.").ids
    held, second = _turn(tagger, tok, reply)
    history = ExactHistory(tok)
    history.record("conv", held)
    prompt = tagger.build(second)
    assert history.splice("conv", prompt) is prompt


def test_history_is_bounded_lru(tok: TextTokenizer) -> None:
    history = ExactHistory(tok, max_conversations=2)
    for key in ("a", "b", "c"):
        history.record(key, tok.encode(key).ids)
    assert len(history) == 2
    with pytest.raises(ValueError, match="max_conversations"):
        ExactHistory(tok, max_conversations=0)
