"""Streaming detokenizer: deltas never split a character, skip special tokens,
and add up to tokenizer.decode of all ids."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvserving.gateway.detokenize import IncrementalDetokenizer
from kvserving.gateway.prompt.tokenizer import TextTokenizer

TEXT = "héllo 日本語のテキスト 🇫🇷 naïve café ✓ — Ωμέγα\n\tтекст 😀👍🏽 end"


def test_byte_level_tokens_split_characters(tokenizer: TextTokenizer) -> None:
    """The premise: single tokens of TEXT decode to broken UTF-8."""
    ids = tokenizer.encode_ids(TEXT)
    assert len(ids) > len(TEXT.split())
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


def test_one_token_at_a_time_equals_decode(tokenizer: TextTokenizer, hf_tokenizer: Any) -> None:
    ids = tokenizer.encode_ids(TEXT)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert "".join(deltas) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert deltas[-1] == ""  # nothing was held back at the end
    assert detok.text == TEXT and detok.count == len(ids)
    # Tokens that end inside a character give '' and the completing token gives it whole.
    held = [k for k, t in enumerate(ids) if tokenizer.decode(ids[: k + 1]).endswith("\ufffd")]
    assert held and all(deltas[k] == "" for k in held)


@pytest.mark.parametrize("seed", range(5))
def test_random_chunks_equal_decode(tokenizer: TextTokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = tokenizer.encode_ids(TEXT * 3)
    detok = IncrementalDetokenizer(tokenizer)
    out, k = [], 0
    while k < len(ids):
        n = rng.randint(1, 4)
        out.append(detok.add(ids[k : k + n]))
        k += n
    out.append(detok.flush())
    assert all("\ufffd" not in d for d in out)
    assert "".join(out) == TEXT * 3


def test_incomplete_character_is_held_back_then_flushed(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode_ids("ok 😀")
    # Find a cut inside the emoji's bytes.
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer)
    first = detok.add(ids[:cut])
    assert first in ("ok", "ok ")
    # The stream ends mid-character: flush gives what decode gives.
    assert first + detok.flush() == tokenizer.decode(ids[:cut])
    assert detok.text.endswith("\ufffd")


def test_special_tokens_skipped_markup_kept(tokenizer: TextTokenizer, hf_tokenizer: Any) -> None:
    ids = tokenizer.encode_ids("<think>\nhm\n</think>\n\nanswer<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert text == "<think>\nhm\n</think>\n\nanswer"
    assert text == hf_tokenizer.decode(ids, skip_special_tokens=True)
    keep = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(keep.add([t]) for t in ids) + keep.flush() == "<think>\nhm\n</think>\n\nanswer<|im_end|>"


def test_skip_ids_drop_stop_tokens_but_count_them(tokenizer: TextTokenizer) -> None:
    eos = tokenizer.eos_token_id
    assert eos is not None
    ids = tokenizer.encode_ids("done") + [eos]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False, skip_ids={eos})
    assert detok.add(ids) + detok.flush() == "done"
    assert detok.count == len(ids) and detok.ids == ids[:-1]


def test_sentencepiece_style_leading_spaces() -> None:
    """Metaspace decoders drop the leading space of the first token only: the
    window keeps context, so later words keep their space."""
    vocab = {"▁Hello": 0, "▁world": 1, "!": 2, "▁again": 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="!"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    tok = TextTokenizer(raw)
    ids = [0, 1, 2, 3]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([t]) for t in ids] + [detok.flush()]
    assert deltas == ["Hello", " world", "!", " again", ""]
    assert "".join(deltas) == tok.decode(ids) == "Hello world! again"


class _Windowed:
    """The tokenizer without ``piece_texts``: every delta through the windowed decode."""

    def __init__(self, tok: TextTokenizer) -> None:
        self.tok = tok

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_piece_texts_only_for_local_whole_tokens(tokenizer: TextTokenizer) -> None:
    ascii_ids = tokenizer.encode_ids("Reading setup.py now.")
    texts = tokenizer.piece_texts(ascii_ids)
    assert texts is not None and "".join(texts) == tokenizer.decode(ascii_ids)
    split = [t for t in tokenizer.encode_ids(TEXT) if "\ufffd" in tokenizer.decode([t])]
    assert split and tokenizer.piece_texts(ascii_ids + split[:1]) is None  # a token that splits a character
    eos = tokenizer.eos_token_id
    assert eos is not None
    assert tokenizer.piece_texts([eos]) == [""] and tokenizer.piece_texts([eos], skip_special_tokens=False) == [
        tokenizer.decode([eos], skip_special_tokens=False)
    ]
    raw = Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1}, unk_token="▁world"))
    raw.decoder = decoders.Metaspace()
    assert TextTokenizer(raw).piece_texts([0, 1]) is None  # not a byte-level decoder: its text depends on position


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("skip_special", [True, False])
def test_piece_texts_deltas_equal_the_windowed_decode(tokenizer: TextTokenizer, seed: int, skip_special: bool) -> None:
    """Random replies (text with split characters, special tokens, any ids), fed in random
    batches: the same deltas with and without ``piece_texts``."""
    rng = random.Random(seed)
    words = (TEXT + " plain ascii words and code() {x: 1}").split(" ")
    specials = sorted(tokenizer.added_tokens)
    ids: list[int] = []
    for _ in range(40):
        pick = rng.random()
        if pick < 0.6:
            ids += tokenizer.encode_ids(" " + rng.choice(words))
        elif pick < 0.8:
            ids.append(rng.choice(specials))
        else:
            ids.append(rng.randrange(tokenizer.vocab_size))
    fast, slow = (
        IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special),
        IncrementalDetokenizer(_Windowed(tokenizer), skip_special_tokens=skip_special),
    )
    pos = 0
    while pos < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        assert fast.add(ids[pos : pos + n]) == slow.add(ids[pos : pos + n])
        pos += n
    assert fast.flush() == slow.flush()
    assert fast.text == slow.text
