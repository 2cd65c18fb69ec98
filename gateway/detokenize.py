"""Incremental detokenizer for streaming: token ids in, text deltas out.

Each step decodes only a short window of recent ids (the "prefix/read
offset" method of TGI and vLLM): `prefix` is text already sent, decoded again
so that decoders that depend on context (SentencePiece's leading space) give
the same characters; the delta is what the window adds beyond it. A delta
that would end in U+FFFD (an incomplete UTF-8 sequence: a multi-byte
character split across byte-level tokens) is held back until the next token
completes it. `flush()` at the end returns the rest, so the concatenation of
all deltas equals `tokenizer.decode(all ids)` (checked there; the windowed
remainder is the fallback). Special tokens are skipped like `decode(...,
skip_special_tokens=True)`; `skip_ids` drops more (e.g. stop tokens).
Tokenization-space clean-up (`clean_up_tokenization_spaces`) is not applied.

Cost per token: two decodes of the ids since the last delta, independent of
the output length; `flush()` decodes everything once. With a tokenizer that
knows each token's text on its own (`TextTokenizer.piece_texts`: a byte-level
decoder, tokens of whole characters) the delta is the new tokens' texts, the
same string without a decode (a token that splits a character takes the
windowed path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for a stream of generated token ids (one per request)."""

    def __init__(self, tokenizer: Decoder, *, skip_special_tokens: bool = True, skip_ids: Iterable[int] = ()) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._skip_ids = frozenset(skip_ids)
        self.ids: list[int] = []
        self.count = 0  # every id received, skipped ones included
        self._prefix = 0  # window start: context already sent
        self._read = 0  # ids before this are sent
        self._sent: list[str] = []
        # TextTokenizer.piece_texts, when the tokenizer has it (test doubles need not)
        self._pieces: Callable[..., list[str] | None] | None = getattr(tokenizer, "piece_texts", None)

    @property
    def text(self) -> str:
        """All text returned so far."""
        return "".join(self._sent)

    def add(self, token_ids: Iterable[int]) -> str:
        """The new text these ids complete ('' while a character is incomplete)."""
        for t in token_ids:
            self.count += 1
            if t not in self._skip_ids:
                self.ids.append(int(t))
        if len(self.ids) == self._read:
            return ""
        fast = self._whole(self.ids[self._read :])
        if fast is not None:
            # Each new token is whole characters and decoding is local: the window's text is
            # its prefix's text followed by theirs, so this is the delta the windowed decode gives.
            if not fast:
                return ""
            self._prefix, self._read = self._read, len(self.ids)
            self._sent.append(fast)
            return fast
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        # The longest run of the new ids that ends on a whole character (a
        # batch whose last token splits a character still sends the rest).
        for end in range(len(self.ids), self._read, -1):
            new_text = self._decode(self.ids[self._prefix : end])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                delta = new_text[len(prefix_text) :]
                # The ids just sent become the next window's context: they
                # start on a character boundary, which an arbitrary cut would not.
                self._prefix, self._read = self._read, end
                self._sent.append(delta)
                return delta
        return ""

    def flush(self) -> str:
        """The rest of the text at the end of the stream (incomplete bytes as U+FFFD)."""
        full = self._decode(self.ids)
        sent = self.text
        if full.startswith(sent):
            rest = full[len(sent) :]
        else:  # a decoder whose output is not local: send the windowed rest
            rest = self._decode(self.ids[self._prefix :])[len(self._decode(self.ids[self._prefix : self._read])) :]
        self._prefix, self._read = self._read, len(self.ids)
        if rest:
            self._sent.append(rest)
        return rest

    def _whole(self, ids: Sequence[int]) -> str | None:
        """The text of ``ids`` when each is whole characters on its own (None: decode)."""
        if self._pieces is None:
            return None
        texts = self._pieces(ids, skip_special_tokens=self._skip_special)
        return None if texts is None else "".join(texts)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special) if ids else ""
