"""The model's tokenizer as the gateway sees it: `tokenizer.json` through the
`tokenizers` package plus the special tokens of `tokenizer_config.json`.

No `transformers` at run time: ids equal `AutoTokenizer.from_pretrained(dir)`
for the chat path (`add_special_tokens=False`), which the tests check.
Special tokens (`special=True` added tokens) are what `decode(...,
skip_special_tokens=True)` drops; every added token (special or not, e.g.
`<think>`, `<tool_call>`) is a *control token* for the tagger.

Content never becomes special tokens: `as_text` breaks every special token's
text inside a content string with `TEXT_MARK` (U+FDD0, a Unicode
noncharacter), which the tokenizer's normalizer removes again. Added tokens
are found on the raw text before normalization, so a broken one is not found
there; the normalizer then joins its characters back and they are tokenized
as the text they are, exactly as `transformers` with `split_special_tokens`
tokenizes them. Text without the mark tokenizes as before. Non-special
added tokens (`<think>`, `<tool_call>`) stay tokens in content: they are
markup the model writes inside its replies, and a reply's text must give its
tokens again.

    content  hi<|im_end|>            -> as_text ->  hi<\ufdd0|im_end|>
    tokens   hi < | im _end | >                     (not the <|im_end|> id)

A special token marked `normalized` (found after normalization, rare in chat
models' tokenizers) is not broken by the mark.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, normalizers

# Special-token names the chat template may read (transformers passes them as
# template variables).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# Added tokens that stand for image or video content (Qwen-VL, LLaVA, Gemma 3,
# Llama 4, Pixtral, ...): the tagger gives them the `image` modality.
IMAGE_TOKEN_PATTERN = re.compile(r"image|vision|img|video|patch", re.IGNORECASE)

# Breaks a special token's text inside content (module docstring); the normalizer removes it.
TEXT_MARK = "\ufdd0"
_UNSEEN: Any = object()  # `piece_texts`: an id whose text is not cached yet


@dataclass(frozen=True, slots=True)
class Encoded:
    """Token ids and each token's character span [start, end) in the text."""

    ids: list[int]
    offsets: list[tuple[int, int]]


class TextTokenizer:
    """Encode and decode text with the model's own tokenizer."""

    def __init__(self, tokenizer: Tokenizer, *, config: dict[str, Any] | None = None) -> None:
        self._tok = tokenizer
        self.config: dict[str, Any] = dict(config or {})
        _add_missing_tokens(tokenizer, self.config)
        added = tokenizer.get_added_tokens_decoder()
        self.content_text = ContentText([t.content for t in added.values() if t.special])
        _remove_text_mark(tokenizer)
        # Characters one token covers at most (a byte-level token's key has one character per
        # byte, at least as many as its text): a text of more characters than
        # max_token_chars x n cannot be n tokens or fewer.
        self.max_token_chars = max((len(k) for k in tokenizer.get_vocab(with_added_tokens=True)), default=1)
        self.added_tokens: dict[int, str] = {i: t.content for i, t in added.items()}
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.image_token_ids: frozenset[int] = frozenset(
            i for i, content in self.added_tokens.items() if IMAGE_TOKEN_PATTERN.search(content)
        )
        self.special_tokens_map: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = _token_content(self.config.get(name))
            if value is not None:
                self.special_tokens_map[name] = value
        eos = self.special_tokens_map.get("eos_token")
        eos_id = tokenizer.token_to_id(eos) if eos is not None else None
        self.eos_token_id: int | None = eos_id
        # A byte-level decoder turns each token into its own fixed bytes and decodes their
        # concatenation: the text of tokens that are each whole UTF-8 characters is the
        # concatenation of their texts (`piece_texts`). SentencePiece-style decoders are
        # not local (a leading space depends on the position), nor are unknown ones.
        self._local = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._pieces: tuple[dict[int, str | None], dict[int, str | None]] = ({}, {})

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextTokenizer:
        """Load `tokenizer.json` and `tokenizer_config.json` from a model directory."""
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model_dir: no tokenizer.json in {root}")
        config = read_tokenizer_config(root)
        return cls(Tokenizer.from_file(str(path)), config=config)

    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers` object itself (token_prefixes reads its added tokens' flags)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> Encoded:
        """Ids and character offsets of `text`, no special tokens added (the chat path)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return Encoded(ids=enc.ids, offsets=enc.offsets)

    def as_text(self, content: str) -> str:
        """``content`` as it goes into a rendered prompt: special tokens' text broken, so that
        it tokenizes as text (module docstring)."""
        return self.content_text.mark(content)

    def encode_ids(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def piece_texts(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> list[str] | None:
        """Each id's text on its own, when ``decode(ids)`` is their concatenation: a
        byte-level decoder and every token whole characters (its text alone holds no
        U+FFFD). None otherwise: the caller decodes. Streaming asks this once per token,
        where a decode call costs ~3 us; each id is decoded once per process."""
        if not self._local:
            return None
        cache = self._pieces[skip_special_tokens]  # at most the vocabulary, twice
        out = list(map(cache.get, ids, repeat(_UNSEEN, len(ids))))  # one C pass; a Python step only per id not seen yet
        if _UNSEEN in out:
            for k, t in enumerate(ids):
                if out[k] is _UNSEEN:
                    alone = self.decode([t], skip_special_tokens=skip_special_tokens)
                    out[k] = cache[t] = None if "\ufffd" in alone else alone
        if None in out:
            return None
        return out  # type: ignore[return-value]  # no None, no _UNSEEN left

    def token_to_id(self, token: str) -> int | None:
        value = self._tok.token_to_id(token)
        return None if value is None else int(value)

    def id_to_token(self, token_id: int) -> str | None:
        value = self._tok.id_to_token(token_id)
        return None if value is None else str(value)


class ContentText:
    """Marks content strings so that no special token's text in them is found as that token.

    A special token is found in a rendered prompt wherever its text is, even across two
    content strings a template joins (text parts, a trimmed string and the next); so
    ``mark`` breaks every whole occurrence after its first character, and a string whose
    (right-trimmed) end could start one gets the mark after it."""

    def __init__(self, specials: Sequence[str]) -> None:
        contents = sorted({t for t in specials if len(t) > 1}, key=len, reverse=True)
        self._heads = tuple(sorted({t[:2] for t in contents}))  # a C scan for each rules most strings out
        self._whole = re.compile("|".join(re.escape(t) for t in contents)) if contents else None
        self._starts = tuple(sorted({t[0] for t in contents}))
        self._first = self._starts[0] if len(self._starts) == 1 else None
        # mark() returns before using this when there is no special token (``_whole`` is None)
        starts = re.compile("[" + "".join(re.escape(c) for c in self._starts) + "]") if self._starts else None
        self._any_first = starts.search if starts is not None else (lambda text: None)
        self._partial = frozenset(t[:k] for t in contents for k in range(1, len(t)))
        self._reach = max((len(t) for t in contents), default=0)

    def mark(self, text: str) -> str:
        """``text`` itself (the same object) when there is nothing to break, else marked."""
        whole = self._whole
        if whole is None or not text:
            return text
        if self._first is not None:
            if self._first not in text:
                return text  # one C scan ("<" begins every special token): most strings end here
        elif not self._any_first(text):
            return text
        if any(h in text for h in self._heads) and whole.search(text):
            text = whole.sub(lambda m: m[0][0] + TEXT_MARK + m[0][1:], text)
        end = len(text.rstrip()) if text[-1].isspace() else len(text)
        low = max(0, end - self._reach + 1)
        for first in self._starts:  # a C scan of the tail per first character ("<")
            k = text.rfind(first, low, end)
            while k >= 0:
                if text[k:end] in self._partial:
                    return text[:end] + TEXT_MARK + text[end:]
                k = text.rfind(first, low, k)
        return text


def _remove_text_mark(tokenizer: Tokenizer) -> None:
    """Put a normalizer step first that removes ``TEXT_MARK`` (a no-op on text without it)."""
    remove = normalizers.Replace(TEXT_MARK, "")
    current = tokenizer.normalizer
    tokenizer.normalizer = remove if current is None else normalizers.Sequence([remove, current])


def read_tokenizer_config(model_dir: str | Path) -> dict[str, Any]:
    """`tokenizer_config.json` as a dict ({} when the file is absent)."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"tokenizer_config.json: expected an object, got {type(data).__name__}")
    return data


def _token_content(value: object) -> str | None:
    """A special-token entry is a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _add_missing_tokens(tokenizer: Tokenizer, config: dict[str, Any]) -> None:
    """Add the `added_tokens_decoder` entries that tokenizer.json lacks (as transformers does)."""
    decoder = config.get("added_tokens_decoder")
    if not isinstance(decoder, dict):
        return
    for token_id in sorted(decoder, key=int):
        entry = decoder[token_id]
        content = _token_content(entry)
        if content is None or tokenizer.token_to_id(content) is not None:
            continue
        token = AddedToken(
            content,
            single_word=bool(entry.get("single_word", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            normalized=bool(entry.get("normalized", False)),
            special=bool(entry.get("special", False)),
        )
        if token.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
