"""Exact history: the next turn's prompt starts with the very token ids the
workers hold for the previous turn (its prompt + the ids the model sampled),
not with a re-tokenization of the text the client sent back.

Why: a sampled reply is often not the canonical tokenization of its own text
(on the tiny model, 68 of 100 random 20-token replies are not; byte-level
tokens that split a UTF-8 character decode to U+FFFD and never come back).
Re-tokenized, the reply's pages hash differently from the pages the decode
worker retained, and bidirectional reuse stops at the previous prompt.

The splice, per conversation (``ExactHistory.splice``):

    previous turn  R = prompt ids + sampled ids     T = decode(R) (special tokens kept)
    new prompt     text = T + rest                  (the template re-rendered the history)
    spliced ids    R + encode(rest)                 used only if decode(spliced) == text

so the model reads exactly the text the template rendered, through the tokens
it produced itself. Tags come from the canonical tagging of the same text:
each spliced token takes the tag of the canonical token that covers its first
character, and the user-turn starts move to the spliced token at the same
character. Anything that does not match (an edited history, a stop string cut
the reply, a client that dropped reasoning) leaves the prompt as rendered.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Protocol

from .tagger import TaggedPrompt
from .tokenizer import Encoded


class SpliceTokenizer(Protocol):
    def encode(self, text: str) -> Encoded: ...

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class _Entry:
    ids: tuple[int, ...]
    text: str


class ExactHistory:
    """The last (prompt + sampled output) ids of each conversation, LRU-bounded."""

    def __init__(self, tokenizer: SpliceTokenizer, *, max_conversations: int = 10_000) -> None:
        if max_conversations < 1:
            raise ValueError(f"max_conversations must be >= 1, got {max_conversations}")
        self.tokenizer = tokenizer
        self.max_conversations = max_conversations
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, key: str, ids: list[int]) -> None:
        """What the workers now hold for conversation ``key``."""
        if not ids:
            return
        self._entries.pop(key, None)
        self._entries[key] = _Entry(tuple(ids), self.tokenizer.decode(list(ids), skip_special_tokens=False))
        while len(self._entries) > self.max_conversations:
            self._entries.popitem(last=False)

    def forget(self, key: str) -> None:
        self._entries.pop(key, None)

    def splice(self, key: str, prompt: TaggedPrompt) -> TaggedPrompt:
        """``prompt`` with its leading tokens replaced by the recorded ids, when they render the same text."""
        entry = self._entries.get(key)
        if entry is None or not entry.text or not prompt.text.startswith(entry.text):
            return prompt
        recorded = list(entry.ids)
        if prompt.input_ids[: len(recorded)] == recorded:
            return prompt  # the canonical ids already extend it: nothing to change
        self._entries.move_to_end(key)
        cut = len(entry.text)
        rest = self.tokenizer.encode(prompt.text[cut:])
        ids = recorded + list(rest.ids)
        if self.tokenizer.decode(ids, skip_special_tokens=False) != prompt.text:
            return prompt
        canon = self.tokenizer.encode(prompt.text).offsets
        if len(canon) != len(prompt.tags):  # tags not of the canonical tokenization: nothing to map from
            return prompt
        starts = self._char_starts(recorded, prompt.input_ids, canon, cut) + [cut + a for a, _ in rest.offsets]
        return _retag(prompt, ids, starts, canon)

    def _char_starts(self, recorded: list[int], canon_ids: list[int], canon: list[tuple[int, int]], cut: int) -> list[int]:
        """First character of each recorded token in the prompt text (monotonic, < ``cut``).

        Tokens the recorded and canonical ids share at the start sit where the
        canonical ones do; after that, a token starts where the decoded text of
        the recorded tokens before it ends. A token ending inside a UTF-8
        character decodes to U+FFFD until the character completes, so starts are
        clamped to never go backwards or past ``cut``.
        """
        common = 0
        for a, b in zip(recorded, canon_ids):
            if a != b:
                break
            common += 1
        starts = [a for a, _ in canon[:common]]
        # Decode from a checkpoint, not from `common`, so a long reply costs O(n):
        # text decoded up to a complete character concatenates with what follows.
        mark = common
        mark_pos = last = canon[common][0] if common < len(canon) else cut
        for i in range(common, len(recorded)):
            piece = self.tokenizer.decode(recorded[mark:i], skip_special_tokens=False)
            pos = mark_pos + len(piece)
            last = min(max(last, pos), cut - 1)
            starts.append(last)
            if i - mark >= 8 and piece and not piece.endswith("\ufffd"):
                mark, mark_pos = i, pos
        return starts


def _retag(prompt: TaggedPrompt, ids: list[int], starts: list[int], canon_offsets: list[tuple[int, int]]) -> TaggedPrompt:
    """Tags and turn starts of ``ids`` (first characters ``starts``) from the canonical tagging."""
    canon_starts = [a for a, _ in canon_offsets]

    def canonical_index(char: int) -> int:
        return max(0, min(len(prompt.tags) - 1, bisect.bisect_right(canon_starts, char) - 1))

    tags = [prompt.tags[canonical_index(c)] for c in starts]
    turn_starts = []
    for t in prompt.turn_starts:
        char = canon_starts[t] if t < len(canon_starts) else len(prompt.text)
        turn_starts.append(min(bisect.bisect_left(starts, char), len(ids) - 1))
    return replace(prompt, input_ids=ids, tags=tags, turn_starts=tuple(turn_starts))
