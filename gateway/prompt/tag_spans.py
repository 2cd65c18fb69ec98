"""From labelled character chunks of the prompt text to one tag per token.

The rules (which role template text takes, where one turn's delimiters end
and the next one's begin, how image placeholders are matched) are stated in
`tagger`'s module docstring; this module applies them to the chunks that
`tag_markers` reads back, using the control tokens' positions from the
tokenizer. Pure: lists in, lists out.
"""

from __future__ import annotations

import bisect
import operator
from itertools import chain, compress, islice, repeat
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from kvserving.tags import SEMANTIC

from .chat_template import Message
from .tag_markers import Chunk, Piece


@dataclass(frozen=True, slots=True)
class Controls:
    """Character spans of the control tokens (added tokens) in the text, in order."""

    spans: list[tuple[int, int]]
    starts: list[int]
    image: frozenset[int]  # starts of image placeholder tokens
    special: frozenset[int]  # starts of special tokens (`<|im_start|>`, not `<think>`)

    def within(self, start: int, end: int) -> list[tuple[int, int]]:
        k = bisect.bisect_left(self.starts, start)
        out = []
        while k < len(self.spans) and self.spans[k][0] < end:
            out.append(self.spans[k])
            k += 1
        return out


# A labelled span of the text: (start, end, owner, semantic index). The owner is the
# message whose turn the span takes (its temporal part comes from that message's
# place in the request: `tagger.message_temporals`), or ALWAYS_CURRENT. Spans hold
# no temporal so that a conversation's next turn can reuse them (they only age).
Span = tuple[int, int, int, int]
ALWAYS_CURRENT = -1
DELIM = SEMANTIC.index("delim")
_SEM = {name: k for k, name in enumerate(SEMANTIC)}


@dataclass(frozen=True, slots=True)
class Resume:
    """Where labelling starts: the first merged chunk to label, the piece before it,
    and the header position after it (``label``'s state at that point)."""

    index: int = 0
    prev: Piece | None = None
    header: int = 0


def merge_chunks(chunks: list[Chunk]) -> list[Chunk]:
    """Neighbouring template-text chunks joined into one gap each."""
    merged: list[Chunk] = []
    for c in chunks:
        if merged and c[2] == -1 and merged[-1][2] == -1 and merged[-1][1] == c[0]:
            merged[-1] = (merged[-1][0], c[1], -1)
        else:
            merged.append(c)
    return merged


def label(
    merged: list[Chunk],
    pieces: list[Piece],
    text: str,
    controls: Controls,
    num_messages: int,
    *,
    resume: Resume = Resume(),
    rendered: AbstractSet[int] | None = None,
) -> tuple[list[Span], dict[int, int]]:
    """Spans covering `text` from merged chunk ``resume.index`` on, and where each
    message's header begins (the character where the template text before its first
    piece, or before its place when it rendered no piece, takes its turn).

    What it decides for a chunk depends on the chunks up to the next piece only (and on
    which messages render a piece at all, ``rendered``): so labels of a prompt's text
    up to a piece stay valid for a longer prompt with the same chunks up to there."""
    spans: list[Span] = []
    headers: dict[int, int] = {}
    # The next piece after each chunk (one backward pass).
    following: list[Piece | None] = [None] * len(merged)
    nxt: Piece | None = None
    for idx in range(len(merged) - 1, resume.index - 1, -1):
        following[idx] = nxt
        if merged[idx][2] >= 0:
            nxt = pieces[merged[idx][2]]
    if rendered is None:
        rendered = rendered_messages(merged, pieces)
    prev, header = resume.prev, resume.header
    for idx in range(resume.index, len(merged)):
        start, end, pid = merged[idx]
        if pid >= 0:
            piece = pieces[pid]
            if piece.message >= 0:
                headers.setdefault(piece.message, min(header, start))
            header = end
            spans.append((start, end, piece.message, _SEM[piece.semantic]))
            prev = piece
            continue
        after = following[idx]
        lo = prev.message + 1 if prev is not None else 0
        hi = after.message if after is not None else num_messages
        skipped = [i for i in range(max(lo, 0), hi) if i not in rendered]
        gap, header, skipped_headers = _gap_spans(start, end, prev, after, text, controls, skipped)
        spans.extend(gap)
        for i, char in skipped_headers.items():
            headers.setdefault(i, char)
    return spans, headers


def rendered_messages(merged: list[Chunk], pieces: list[Piece]) -> set[int]:
    """The messages with at least one piece in the text."""
    return {pieces[c[2]].message for c in merged if c[2] >= 0}


def _gap_spans(
    start: int,
    end: int,
    prev: Piece | None,
    nxt: Piece | None,
    text: str,
    controls: Controls,
    skipped: list[int],
) -> tuple[list[Span], int, dict[int, int]]:
    """Template text between two pieces (rule in the module doc): its spans,
    where the next piece's header begins, and the headers of the messages in
    between that rendered no piece (`skipped`: their indices, e.g. an empty
    user message). Spans name their owner message, not a turn (`Span`).

    The delimiter part switches from the turn of the piece before to the turn
    of the piece after at the last opener: a control token that begins a line
    (after a line break, another control token or the gap's start) and is
    followed by text on that line (`<|im_start|>user`, not `<|im_end|>` at a line end;
    image tokens do not count), a special one rather than markup where there
    is one: `<|im_end|>` and its line break close the previous message,
    `<|im_start|>user` opens the next one. When the gap holds one such opener
    per skipped message plus the next piece's, each skipped message takes the
    stretch from its opener.
    """
    if prev is not None and nxt is not None and prev.region == nxt.region:
        return [(start, end, prev.message, _SEM[prev.semantic])], start, {}
    inside = controls.within(start, end)
    first = text.find("\n", start, end)
    first = end if first < 0 else first
    last = text.rfind("\n", start, end)
    last = start if last < 0 else last + 1
    if inside:
        first = min(first, inside[0][0])
        last = max(last, min(inside[-1][1], end))
    if prev is None:
        first = start
    if nxt is None:
        last = end
    if first >= last:  # no boundary at all: the gap follows the piece before
        owner = prev if prev is not None else nxt
        if owner is None:
            return [(start, end, ALWAYS_CURRENT, DELIM)], start, {}
        return [(start, end, owner.message, _SEM[owner.semantic])], start, {}
    ends = {b for _, b in inside}
    begins = {a for a, _ in inside}
    openers = [
        a
        for a, b in inside
        if first <= a < last
        and a not in controls.image
        and (a == first or text[a - 1] == "\n" or a in ends)  # begins a line
        and (b >= end or (text[b] != "\n" and b not in begins))  # and names something: `<|im_start|>user`
    ]
    special = [a for a in openers if a in controls.special]
    candidates = special or openers
    before = prev.message if prev is not None else ALWAYS_CURRENT
    after = nxt.message if nxt is not None else ALWAYS_CURRENT
    # Owners of the delimiter stretches that start at each cut.
    if skipped and len(candidates) == len(skipped) + 1:
        cuts, owners = candidates, [*skipped, after]
    elif skipped and nxt is None and len(candidates) == len(skipped):
        cuts, owners = candidates, list(skipped)
    else:
        cuts, owners, skipped = [candidates[-1] if candidates else first], [after], []
    # The system block's own prose is instruction too: after its last piece up
    # to the first special token (tool-use instructions before `<|im_end|>`),
    # and before its first piece from the line after its opener's header
    # ("# Tools ..." after `<|im_start|>system`).
    if prev is not None and prev.semantic == "inst":
        stop = next((a for a, _ in inside if a >= first and a in controls.special), cuts[0])
        first = max(first, min(stop, cuts[0]))
    if nxt is not None and nxt.semantic == "inst" and candidates:
        body = text.find("\n", cuts[-1], last)
        if body >= 0:
            while body < last and text[body] == "\n":
                body += 1
            last = body
    spans: list[Span] = []
    if prev is not None and first > start:
        spans.append((start, first, prev.message, _SEM[prev.semantic]))
    if cuts[0] > first:
        spans.append((first, cuts[0], before, DELIM))
    for j, (cut, turn_owner) in enumerate(zip(cuts, owners, strict=True)):
        stop = cuts[j + 1] if j + 1 < len(cuts) else last
        spans.append((cut, stop, turn_owner, DELIM))
    if nxt is not None and last < end:
        spans.append((last, end, nxt.message, _SEM[nxt.semantic]))
    return spans, cuts[-1], {i: cuts[j] for j, i in enumerate(skipped)}


# Consecutive tokens with one label: (end token, owner, base), base = modal * 7 + semantic.
Run = tuple[int, int, int]


def token_runs(spans: list[Span], starts: Sequence[int], first: int = 0) -> list[Run]:
    """Runs of the tokens from ``first`` on: each token (given by its first character,
    ``starts``) takes the label of the span holding it; tokens no span holds are
    current delimiters."""
    runs: list[Run] = []
    pos, n = first, len(starts)
    for a, b, owner, sem in spans:
        # Spans are in text order and do not overlap, so each one's tokens are the next slice.
        lo = bisect.bisect_left(starts, a, pos, n)
        hi = bisect.bisect_left(starts, b, lo, n)
        if hi <= lo:
            continue
        if lo > pos:
            _extend(runs, lo, ALWAYS_CURRENT, DELIM)
        _extend(runs, hi, owner, sem)
        pos = hi
    if pos < n:
        _extend(runs, n, ALWAYS_CURRENT, DELIM)
    return runs


def _extend(runs: list[Run], end: int, owner: int, base: int) -> None:
    if runs and runs[-1][1] == owner and runs[-1][2] == base:
        runs[-1] = (end, owner, base)
    else:
        runs.append((end, owner, base))


def final_runs(runs: Sequence[Run], temporal_of: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The tags of ``runs`` as runs of (end token, tag), neighbours with one tag joined: each
    run's owner gives its temporal index (``temporal_of[message]``). In C passes (map, compress),
    not a Python step per run: a conversation's runs grow with its history."""
    if not runs:
        return ()
    width = 2 * len(SEMANTIC)  # tag = (temporal * 2 + modal) * 7 + semantic = temporal * 14 + base
    # the tag offset of each owner; ALWAYS_CURRENT (-1) reads the last entry: current, offset 0
    offset = [t * width for t in temporal_of]
    offset.append(0)
    ends, owners, bases = zip(*runs, strict=True)
    tags = list(map(operator.add, map(offset.__getitem__, owners), bases))
    # a run ends where the next one's tag differs (the last one always ends)
    last = map(operator.ne, tags, islice(tags, 1, None))
    return tuple(compress(zip(ends, tags), chain(last, (True,))))


def expand_runs(runs: Sequence[tuple[int, int]]) -> list[int]:
    """One tag per token from (end token, tag) runs."""
    if not runs:
        return []
    ends, tags = zip(*runs, strict=True)
    lengths = map(operator.sub, ends, chain((0,), ends))  # each run's tokens
    return list(chain.from_iterable(map(repeat, tags, lengths)))


def runs_before(runs: Sequence[Run], end: int) -> tuple[Run, ...]:
    """The runs of the tokens before token ``end`` (runs end in increasing order: one bisection)."""
    if end <= 0:
        return ()
    k = bisect.bisect_left(runs, end, key=_END)  # the first run that reaches ``end``
    if k >= len(runs):
        return tuple(runs)
    _, owner, base = runs[k]
    return (*runs[:k], (end, owner, base))


_END = operator.itemgetter(0)


# -- images and turns ---------------------------------------------------------


def image_runs(ids: list[int], image_ids: frozenset[int], *, start: int = 0) -> list[tuple[int, int]]:
    """(first, end) of each run of image placeholder ids among ``ids[start:]`` (the caller
    knows the ids before ``start`` hold none)."""
    runs: list[tuple[int, int]] = []
    tail = ids[start:] if start else ids
    if image_ids.isdisjoint(tail):
        return runs
    first = -1
    for k, t in enumerate(tail, start):
        if t in image_ids:
            if first < 0:
                first = k
        elif first >= 0:
            runs.append((first, k))
            first = -1
    if first >= 0:
        runs.append((first, len(ids)))
    return runs


def insert_images(
    chunks: list[Chunk],
    runs: list[tuple[int, int]],
    images: list[int],
    offsets: list[tuple[int, int]],
    pieces: list[Piece],
    msgs: list[Message],
) -> list[Chunk]:
    """Image placeholder runs as pieces of their message (matched in order to
    the request's image parts), cut out of the template text around them."""
    spans: list[tuple[int, int, int]] = []
    for (a, b), i in zip(runs, images, strict=True):
        semantic = "obs" if msgs[i]["role"] == "tool" else "user"
        spans.append((offsets[a][0], offsets[b - 1][1], len(pieces)))
        pieces.append(Piece(semantic, ("msg", i), i))
    out: list[Chunk] = []
    k = 0
    for start, end, pid in chunks:
        if pid >= 0:
            out.append((start, end, pid))
            continue
        pos = start
        while k < len(spans) and spans[k][0] < end:
            a, b, image_pid = spans[k]
            if a < pos:  # inside a content piece: not a template placeholder
                k += 1
                continue
            if a > pos:
                out.append((pos, a, -1))
            out.append((a, min(b, end), image_pid))
            pos = min(b, end)
            k += 1
        if pos < end:
            out.append((pos, end, -1))
    return out


def tag_images(tags: list[int], runs: list[tuple[int, int]]) -> None:
    """Image placeholder tokens keep their role and turn, with the image modality."""
    width = len(SEMANTIC)
    for a, b in runs:
        for k in range(a, b):
            tm, s = divmod(tags[k], width)
            tags[k] = ((tm // 2) * 2 + 1) * width + s


def turn_starts(msgs: list[Message], headers: dict[int, int], token_starts: Sequence[int]) -> tuple[int, ...]:
    """Token index where each user turn begins: its message's header (e.g.
    `<|im_start|>user`), found before its first piece (text or image); ``token_starts``:
    each token's first character."""
    return tuple(
        max(0, bisect.bisect_right(token_starts, headers[i]) - 1) for i, m in enumerate(msgs) if m["role"] == "user" and i in headers
    )
