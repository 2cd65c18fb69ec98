"""Exact history: the next turn's prompt starts with the very token ids the
workers hold for the previous turn (its prompt + the ids the model sampled),
not with a re-tokenization of the text the client sent back.

Why: a sampled reply is often not the canonical tokenization of its own text
(on the tiny model, 68 of 100 random 20-token replies are not; byte-level
tokens that split a UTF-8 character decode to U+FFFD, and special tokens the
model sampled are hidden from the client). Re-tokenized, the reply's pages
hash differently from the pages the decode worker retained, and bidirectional
reuse stops at the previous prompt.

Per conversation the gateway records what it sent and what came back::

    held ids    = prompt ids (as sent)            + sampled ids
    held text   = the prompt's rendered text      + the reply text the client got
    held starts = first character of each held id in the held text
                  (a hidden special token has no width: it starts where the next visible one does)

and the next turn, whose template re-renders the history:

    new text    = held text + rest                (else: no splice)
    new ids     = held ids + encode(rest)

Tags come from the canonical tagging of the new text: every token takes the
tag of the canonical token covering its first character, and each user turn
starts at the first token at or after its header's character. Anything that
does not extend the held text (an edited history, a stop string cut the
reply, a client that dropped the reasoning) leaves the prompt as rendered.

What is held is the conversation record's ``held`` (conversations.py), bounded
by the store's budget; this module computes it (``ExactHistory.held_after``)
and splices with it (``ExactHistory.splice``), and keeps nothing itself.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Protocol

from .prompt.tag_spans import expand_runs
from .prompt.tagger import TaggedPrompt
from .prompt.token_prefixes import joined_elements as _joined_elements
from .prompt.token_prefixes import json_elements as _elements
from .prompt.tokenizer import Encoded


class SpliceTokenizer(Protocol):
    def encode(self, text: str) -> Encoded: ...

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...

    def piece_texts(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> list[str] | None: ...


@dataclass(frozen=True, slots=True)
class Sent:
    """A prompt as sent to the workers (``prompt.char_starts`` places each of its ids
    in ``prompt.text``); ``spliced``: it starts with held ids, not as rendered.
    ``ids_json``: the JSON array of ``prompt.input_ids`` (the worker body's ids), built
    from the held ids' text when the ids extend them: encoding tens of thousands of ids
    one int at a time was ~2-4 ms of a long conversation's turn, before its request left."""

    prompt: TaggedPrompt
    spliced: bool
    ids_json: str


@dataclass(frozen=True, slots=True)
class Held:
    """What the workers hold for a conversation (module docstring)."""

    # Arrays, not tuples: a conversation's held ids and starts live for minutes, and a
    # tuple of ints is a container the cyclic GC traverses element by element (tens of
    # ms per young collection over a few hundred conversations: docs/performance-log/gateway.md).
    ids: array[int]
    starts: array[int]
    text: str
    ids_json: str  # the held ids as JSON array elements ("1,2,3"; "" for none)


def _as_rendered(prompt: TaggedPrompt) -> Sent:
    """``prompt`` sent as rendered (nothing held to extend): its ids' JSON from the tagger
    (the kept prefix's text plus the new ids'), else encoded whole."""
    return Sent(prompt, spliced=False, ids_json=f"[{prompt.ids_json or _elements(prompt.input_ids)}]")


class ExactHistory:
    """Splices a prompt onto what the workers hold, and computes what they hold after a turn
    (~20 bytes a held token: its id, its start, its text and its JSON)."""

    def __init__(self, tokenizer: SpliceTokenizer) -> None:
        self.tokenizer = tokenizer

    def held_after(self, sent: Sent, output_ids: list[int], output_text: str) -> Held:
        """After a turn: ``sent`` went out, ``output_ids`` came back, the client got ``output_text``."""
        # Trailing tokens the client never saw (the stop token) go: the template renders its
        # own end-of-turn text after the reply, and the worker never computed the KV of the
        # last sampled token anyway.
        output_ids = list(output_ids)
        while output_ids and self.tokenizer.decode(output_ids[-1:]) == "":
            output_ids.pop()
        cut = len(sent.prompt.text)
        starts = array("i", self._char_starts(sent.prompt))
        starts.extend(self._visible_starts(output_ids, output_text, shift=cut))
        ids = array("i", sent.prompt.input_ids)
        ids.extend(output_ids)
        return Held(ids, starts, sent.prompt.text + output_text, _joined_elements(sent.ids_json[1:-1], _elements(output_ids)))

    def splice(self, held: Held | None, prompt: TaggedPrompt) -> Sent:
        """The prompt to send: the held ids + the rest, when the new text extends the held text."""
        if held is None or not prompt.text.startswith(held.text):
            return _as_rendered(prompt)
        n = len(held.ids)
        if (
            len(prompt.input_ids) >= n and array("i", prompt.input_ids[:n]) == held.ids
        ):  # the rendered ids already extend what the workers hold
            return Sent(prompt, spliced=False, ids_json=f"[{_joined_elements(held.ids_json, _elements(prompt.input_ids[n:]))}]")
        canon = self._char_starts(prompt)
        if len(canon) != len(prompt.tags):
            return _as_rendered(prompt)
        cut = len(held.text)
        rest = self.tokenizer.encode(prompt.text[cut:])
        ids = held.ids.tolist() + list(rest.ids)
        starts = held.starts + array("i", [cut + a for a, _ in rest.offsets])
        return Sent(_retag(prompt, ids, starts, canon), spliced=True, ids_json=f"[{_joined_elements(held.ids_json, _elements(rest.ids))}]")

    def _char_starts(self, prompt: TaggedPrompt) -> Sequence[int]:
        """Where each token of ``prompt`` starts in its text: the tagger's offsets, or (a
        prompt built without them) the canonical tokenization's."""
        if len(prompt.char_starts) == len(prompt.input_ids):
            return prompt.char_starts
        return array("i", [a for a, _ in self.tokenizer.encode(prompt.text).offsets])

    def _visible_starts(self, ids: list[int], text: str, *, shift: int = 0) -> list[int]:
        """First character of each sampled id in the text the client got (hidden specials: no width),
        plus ``shift``.

        Decoding restarts from a checkpoint once the text so far ends on a whole
        character, so a long reply costs O(n) decodes of a few tokens each; none when
        each id is whole characters and decoding is local (``piece_texts``): then the
        text before id i is the texts of the ids before it (running sums in C).
        """
        texts = self.tokenizer.piece_texts(ids)
        if texts is not None:
            out = list(accumulate(map(len, texts), initial=shift))
            out.pop()  # the end of the last piece
            end = shift + len(text)
            if out and out[-1] > end:  # the pieces run past the text: starts stop at its end
                out = [min(pos, end) for pos in out]
            return out
        starts: list[int] = []
        mark, mark_pos, last = 0, 0, 0
        for i in range(len(ids)):
            piece = self.tokenizer.decode(ids[mark:i])
            pos = mark_pos + len(piece)
            last = min(max(last, pos), len(text))
            starts.append(last)
            if i - mark >= 8 and piece and not piece.endswith("\ufffd"):
                mark, mark_pos = i, pos
        return [shift + a for a in starts] if shift else starts


def _retag(prompt: TaggedPrompt, ids: list[int], starts: Sequence[int], canon_starts: Sequence[int]) -> TaggedPrompt:
    """Tags and user-turn starts of ``ids`` (first characters ``starts``) from the canonical tagging.

    Each token takes the tag of the last canonical token starting at or before its first
    character. With the canonical tags as runs (`TaggedPrompt.tag_runs`) that is one
    bisection per run, not per token: a run of canonical tokens [s, e) covers the
    characters from canon_starts[s] up to canon_starts[e]."""
    runs = prompt.tag_runs or _runs_of(prompt.tags)
    out_runs: list[tuple[int, int]] = []
    lo, n = 0, len(canon_starts)
    for k, (end, tag) in enumerate(runs):
        hi = len(starts) if k == len(runs) - 1 or end >= n else bisect.bisect_left(starts, canon_starts[end], lo)
        if hi > lo:
            if out_runs and out_runs[-1][1] == tag:
                out_runs[-1] = (hi, tag)
            else:
                out_runs.append((hi, tag))
            lo = hi
    turn_starts = tuple(
        min(bisect.bisect_left(starts, canon_starts[t] if t < len(canon_starts) else len(prompt.text)), len(ids) - 1)
        for t in prompt.turn_starts
    )
    return replace(
        prompt,
        input_ids=ids,
        tags=expand_runs(out_runs),
        turn_starts=turn_starts,
        char_starts=starts,
        tag_runs=tuple(out_runs),
        ids_json="",
    )


def _runs_of(tags: list[int]) -> list[tuple[int, int]]:
    """(end token, tag) runs of a tag list (a prompt tagged without runs: one step per token)."""
    out: list[tuple[int, int]] = []
    for k, tag in enumerate(tags):
        if out and out[-1][1] == tag:
            out[-1] = (k + 1, tag)
        else:
            out.append((k + 1, tag))
    return out
